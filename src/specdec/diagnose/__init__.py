"""Is speculative decoding paying on a live server, and if not, why?

    metrics.py     /metrics text -> spec-decode series (vLLM, SGLang, specdec); scrapes and deltas
    acceptance.py  counters -> acceptance rate, mean acceptance length, per-position curves
    theory.py      a curve -> expected tokens per pass, speedup at cost ratio c, the best k
    verdict.py     acceptance -> "speculation loses" / "marginal" / "healthy", reasons, next steps
    core.py        `diagnose(source, ...)`: the whole pipeline, as the `--json` dict
    pretty.py      the rich terminal view of that dict
    watch.py       the live view (`specdec watch`)
    report.py      HTML + PNG plots from diagnose / eval / bench JSON (`specdec report`)
"""

from .core import diagnose

__all__ = ["diagnose"]
