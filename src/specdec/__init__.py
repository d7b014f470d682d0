"""specdec: EAGLE-3 speculative decoding, from target model to served, explained drafter."""

__version__ = "0.1.0"
