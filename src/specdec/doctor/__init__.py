"""`doctor`: tell an integration fault from a weak drafter from overhead, with evidence.

  checks.py  static checks before anything runs: each engine's reading of the folder against the
             ids it was trained on, the vocab mapping, the target, and the provenance `train`
             recorded (chat template and tokenizer, target weights, drafter weight norms)
  sweep.py   the reference (the drafter as configured in specdec's engine, prompt by prompt) and
             acceptance under each hypothesis of what serving got wrong, paired with it, each
             row saying whether the switch moves acceptance on this target at all
  walk.py    a hypothesis measured on the reference's own text, as the engine would count it
  live.py    a live server against the reference: the same prompts through its API and through
             specdec's engine, compared per position with confidence intervals and per prompt
"""

from .sweep import HYPOTHESES, diagnose_drafter

__all__ = ["HYPOTHESES", "diagnose_drafter"]
