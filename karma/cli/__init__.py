"""Command-line entry points (karma-plan, karma-profile, ...)."""
