// karma's caching allocator for the CPU backend: see [Note: a caching allocator for the CPU
// backend] in karma/runtime/cpu_cache.py, which builds this file and drives it through ctypes.
//
// Tensors of kMinCachedBytes or more that PyTorch frees are kept, by size, for the next
// tensor of the same size, as long as the bytes held (live and kept) stay within a limit:
// the schedule's planned peak. Smaller tensors go to glibc's bins, which already reuse them.
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kMinCachedBytes = 64 << 10;
constexpr size_t kPageBytes = 4096;

struct State {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;      // block -> its rounded size, ours only
  std::map<size_t, std::vector<void*>> idle;   // rounded size -> freed blocks kept
  size_t live_bytes = 0, idle_bytes = 0, limit_bytes = SIZE_MAX;
  size_t peak_bytes = 0;                       // of live + idle
  uint64_t hits = 0, misses = 0, released = 0;
  bool caching = false;                        // off: freed blocks go straight back
  c10::DeleterFnPtr fallback_deleter = &c10::free_cpu;  // the replaced allocator's
};

State& state() {
  static State* s = new State();  // never destroyed: blocks may be freed at exit
  return *s;
}

size_t rounded(size_t nbytes) {
  return (nbytes + kPageBytes - 1) / kPageBytes * kPageBytes;
}

// Gives kept blocks back to the system, largest first, until `need` more bytes fit under
// the limit or nothing is kept. Called with the lock held.
void release_for(State& s, size_t need) {
  while (s.idle_bytes > 0 && s.live_bytes + s.idle_bytes + need > s.limit_bytes) {
    auto it = std::prev(s.idle.end());
    void* block = it->second.back();
    it->second.pop_back();
    s.idle_bytes -= it->first;
    s.released += 1;
    if (it->second.empty()) s.idle.erase(it);
    c10::free_cpu(block);
  }
}

void release_all(State& s) {
  for (auto& [size, blocks] : s.idle)
    for (void* block : blocks) c10::free_cpu(block), s.released += 1;
  s.idle.clear();
  s.idle_bytes = 0;
}

void note_peak(State& s) {
  if (s.live_bytes + s.idle_bytes > s.peak_bytes) s.peak_bytes = s.live_bytes + s.idle_bytes;
}

void delete_block(void* block) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  auto it = s.live.find(block);
  if (it == s.live.end()) {  // a small tensor's memory, freed through raw_deleter()
    lock.unlock();
    s.fallback_deleter(block);
    return;
  }
  size_t nbytes = it->second;
  s.live.erase(it);
  s.live_bytes -= nbytes;
  if (s.caching && s.live_bytes + s.idle_bytes + nbytes <= s.limit_bytes) {
    s.idle[nbytes].push_back(block);
    s.idle_bytes += nbytes;
    return;
  }
  lock.unlock();
  c10::free_cpu(block);
}

struct CachingCPUAllocator final : public c10::Allocator {
  c10::Allocator* fallback = nullptr;  // the allocator this one replaced: small tensors

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < kMinCachedBytes) return fallback->allocate(nbytes);
    size_t size = rounded(nbytes);
    State& s = state();
    std::unique_lock<std::mutex> lock(s.mu);
    void* block = nullptr;
    auto it = s.idle.find(size);
    if (it != s.idle.end()) {
      block = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) s.idle.erase(it);
      s.idle_bytes -= size;
      s.hits += 1;
    } else {
      release_for(s, size);
      s.misses += 1;
      lock.unlock();
      try {
        block = c10::alloc_cpu(size);
      } catch (const c10::Error&) {  // out of memory: give back all that is kept, once more
        lock.lock();
        release_all(s);
        lock.unlock();
        block = c10::alloc_cpu(size);
      }
      lock.lock();
    }
    s.live.emplace(block, size);
    s.live_bytes += size;
    note_peak(s);
    return {block, block, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CachingCPUAllocator* installed = nullptr;

// A fork (a DataLoader worker) must not inherit the lock held by another thread.
void before_fork() { state().mu.lock(); }
void after_fork() { state().mu.unlock(); }

}  // namespace

extern "C" {

// Makes this the CPU allocator (once per process) and turns caching on under `limit_bytes`.
void karma_cache_install(uint64_t limit_bytes) {
  State& s = state();
  if (installed == nullptr) {
    installed = new CachingCPUAllocator();
    installed->fallback = c10::GetCPUAllocator();
    if (installed->fallback->raw_deleter() != nullptr)
      s.fallback_deleter = installed->fallback->raw_deleter();
    pthread_atfork(before_fork, after_fork, after_fork);
    c10::SetCPUAllocator(installed, /*priority=*/0);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.caching = true;
  s.limit_bytes = limit_bytes;
  s.peak_bytes = s.live_bytes + s.idle_bytes;
  s.hits = s.misses = s.released = 0;
  release_for(s, 0);
}

// Sets the limit, giving back at once what it no longer allows.
void karma_cache_limit(uint64_t limit_bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.limit_bytes = limit_bytes;
  release_for(s, 0);
}

// Turns caching off and gives back every kept block; blocks still live stay valid.
void karma_cache_stop() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.caching = false;
  release_all(s);
}

// live, idle, peak (of live + idle), limit bytes; hits, misses, released blocks.
void karma_cache_stats(uint64_t* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  out[0] = s.live_bytes;
  out[1] = s.idle_bytes;
  out[2] = s.peak_bytes;
  out[3] = s.limit_bytes;
  out[4] = s.hits;
  out[5] = s.misses;
  out[6] = s.released;
}

}  // extern "C"
