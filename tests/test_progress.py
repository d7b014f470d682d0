"""Long stages stay visible in log files: off a terminal, the bar also prints plain lines."""

import io

from rich.console import Console

from specdec.progress import progress_bar


def test_a_log_file_gets_plain_lines_with_count_stats_and_eta():
    log = io.StringIO()
    bar = progress_bar(console=Console(file=log, force_terminal=False, width=120))
    bar.every = 0.0  # a line at every update
    with bar:
        task = bar.add_task("capturing", total=10, rate="")
        bar.update(task, advance=3, rate="123 tok/s")
        bar.advance(task)
    lines = [ln for ln in log.getvalue().splitlines() if ln.startswith("capturing 3/10")]
    assert lines and "123 tok/s" in lines[0]
    assert "capturing 4/10" in log.getvalue()


def test_a_terminal_gets_only_the_bar():
    log = io.StringIO()
    bar = progress_bar(console=Console(file=log, force_terminal=True, width=120))
    bar.every = 0.0
    with bar:
        task = bar.add_task("capturing", total=10, rate="")
        bar.update(task, advance=3, rate="123 tok/s")
    assert "capturing 3/10 " not in log.getvalue()
