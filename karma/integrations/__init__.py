"""karma inside other training frameworks.

- hf_trainer: `KarmaTrainer`, the Hugging Face `transformers.Trainer` training through karma
  (`pip install karma[hf]`).

Each integration imports its framework itself: `import karma.integrations` needs none of them.
"""
