"""Fuyou in the training loops people already have. ``transformers``: ``FuyouTrainer``, a
Hugging Face ``Trainer`` whose optimizer is Fuyou's; ``peft``: PEFT adapters saved as PEFT
saves them, and the merged model; ``trl``: TRL's SFT, DPO and GRPO trainers, their
reference model streamed from the SSD array. (Accelerate needs no module: its
loop takes ``attach(...).optimizer`` as its optimizer; docs/guide/recipes.md.) Each
module imports its framework only when imported itself."""
