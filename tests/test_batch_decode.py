"""engine/batch.py: batched greedy decoding over a static cache equals decoding each prompt alone
(the reference engine), for every architecture the fast path supports, left padding and all."""

import pytest
import torch

from specdec.engine.api import SamplingParams
from specdec.engine.batch import BatchDecoder, _row_chunks
from specdec.engine.engine import SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 13], [7] * 11, [3, 1, 4, 1, 5, 9, 2, 6], [42]]


def alone(target, prompts, n, eos):
    """Each prompt decoded by itself with the reference engine, cut at the first token in `eos`."""
    engine = SpeculativeEngine(target)
    out = []
    for p in prompts:
        ids = engine.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids
        cut = next((i for i, t in enumerate(ids) if t in eos), None)
        out.append((ids, "length") if cut is None else (ids[: cut + 1], "stop"))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_batch_equals_each_prompt_alone(tiny_targets, arch):
    target = tiny_targets[arch]
    dec = BatchDecoder(target.model)
    ref = alone(target, PROMPTS, 10, set())
    assert dec.generate(PROMPTS, 10, eos=[]) == ref
    # An end token that a prompt first meets after its first step stops that row there, and every
    # other row at its own first one; a second batch of another shape on the same decoder too.
    row, i = next((r, i) for r, (ids, _) in enumerate(ref) for i in range(1, len(ids)) if ids[i] not in ids[:i])
    stop = ref[row][0][i]
    cut = alone(target, PROMPTS, 10, {stop})
    assert cut[row] == (ref[row][0][: i + 1], "stop")
    assert dec.generate(PROMPTS, 10, eos=[stop]) == cut
    assert dec.generate(PROMPTS[2:], 7, eos=[stop]) == alone(target, PROMPTS[2:], 7, {stop})


def test_prefill_rows_are_split_to_bound_the_mask():
    chunks = _row_chunks(B=256, P=1000, S=1400, groups=3, budget=1 << 28)
    assert chunks[0] == slice(0, 63) and chunks[-1].stop == 256
    assert sum(c.stop - c.start for c in chunks) == 256
    assert _row_chunks(B=4, P=8, S=128, groups=3) == [slice(0, 4)]


def test_rows_that_all_end_stop_the_batch_early(tiny_targets):
    """Every row's first token is an end token: the loop stops at its first check, and each row is
    that one token with "stop"."""
    target = tiny_targets["llama"]
    firsts = [ids[0] for ids, _ in alone(target, PROMPTS, 1, set())]
    dec = BatchDecoder(target.model, check_every=2)
    calls = []
    step = dec._step
    dec._step = lambda *a: (calls.append(1), step(*a))
    assert dec.generate(PROMPTS, 40, eos=firsts) == [([t], "stop") for t in firsts]
    assert len(calls) == 1  # one step before the check at step 2 saw every row done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_what_eager_steps_compute(tiny_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).cuda()
    eager = BatchDecoder(model, cuda_graphs=False)
    graphs = BatchDecoder(model)
    want = eager.generate(PROMPTS, 20, eos=[])
    assert graphs.generate(PROMPTS, 20, eos=[]) == want
    # Another shape (a new capture), then the first again (captured afresh, same tokens).
    assert graphs.generate(PROMPTS[1:], 9, eos=[]) == eager.generate(PROMPTS[1:], 9, eos=[])
    assert graphs.generate(PROMPTS, 20, eos=[]) == want
    stop = want[0][0][2]
    assert graphs.generate(PROMPTS, 20, eos=[stop]) == eager.generate(PROMPTS, 20, eos=[stop])


def test_a_sliding_window_shorter_than_the_sequence_is_refused(tiny_targets):
    """Mistral's window: the decoder attends every slot, so it takes only sequences the window covers
    (regenerate then hands the batch to HF generate)."""
    target = tiny_targets["mistral"]
    window = target.config.sliding_window
    dec = BatchDecoder(target.model)
    assert dec.fits(window) and not dec.fits(window + 1)
    assert BatchDecoder(tiny_targets["llama"].model).fits(10**6)
