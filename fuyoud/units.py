"""Sizes in bytes: parsing ("64MiB"), printing, alignment. They live in fuyou_proto.units,
beside the other rules the daemon and its clients share; the daemon's modules import them
from here."""
from fuyou_proto.units import align_down, align_up, format_size, parse_size

__all__ = ["align_down", "align_up", "format_size", "parse_size"]
