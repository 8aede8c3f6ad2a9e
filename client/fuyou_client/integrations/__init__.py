"""Fuyou in the training loops people already have. ``transformers``: ``FuyouTrainer``, a
Hugging Face ``Trainer`` whose optimizer is Fuyou's. (Accelerate needs no module: its
loop takes ``attach(...).optimizer`` as its optimizer; docs/guide/recipes.md.) Each
module imports its framework only when imported itself."""
