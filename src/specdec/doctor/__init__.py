"""`doctor`: tell an integration fault from a weak drafter from overhead, with evidence.

  checks.py  static checks before anything runs: each engine's reading of the folder against the
             ids it was trained on, the vocab mapping, the target, and the provenance `train`
             recorded (chat template and tokenizer, target weights, drafter weight norms)
  sweep.py   acceptance with specdec's engine under each hypothesis of what serving got wrong,
             each row saying whether the switch moves acceptance on this target at all
  live.py    a live server against the reference: the same prompts through its API and through
             specdec's engine, compared per position with confidence intervals
"""

from .sweep import HYPOTHESES, diagnose_drafter

__all__ = ["HYPOTHESES", "diagnose_drafter"]
