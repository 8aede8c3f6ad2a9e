"""fuyoud: the per-host Fuyou daemon (SSD array, shared pinned memory, I/O engines)."""
__version__ = "0.1.0"
