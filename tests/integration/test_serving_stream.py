"""Streamed and sampled generation over real worker processes, as a requester sees it.

Three workers serve a decoder in Galaxy's mode; a streamed request's chunks,
put together, are its final answer; seeded sampling gives the same tokens
twice, streamed or not, and the tokens a single process samples from the same
weights with the same seed; a stop token ends the answer (and is left out).
"""

from __future__ import annotations

import pytest
import torch

from common.serving_messages import InferChunk, InferReply, ServeSpec
from services.cli.serve import infer_request, stream_request
from services.lib.galaxy import model
from services.lib.galaxy.sampling import GREEDY, Sampler
from tests.integration.test_serving import DECODER, Serving
from tests.integration.test_serving import serving as serving  # the fixture

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 3, 250, 9, 9, 1, 42]
NEW = 10


def _reference(w: dict[str, torch.Tensor], sampler: Sampler) -> list[int]:
    """One process, no cache, no ring: the whole sequence re-run at each step."""
    config, seq, out = DECODER.config(), torch.tensor(PROMPT), []
    with torch.no_grad():
        for step in range(NEW):
            token = sampler(model.forward(seq, w, config)[-1], step)
            out.append(token)
            seq = torch.cat([seq, torch.tensor([token])])
    return out


def test_streamed_seeded_sampling_matches_the_single_process_reference(serving: Serving) -> None:
    spec = ServeSpec(serve_id="stream", model=DECODER, seed=3, mode="galaxy", seq_len=12)
    serving.start(spec)
    w = model.init_weights(DECODER.config(), 3)
    options = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    want = _reference(w, Sampler(0.9, 0.95, 7))
    assert want != _reference(w, GREEDY)  # the sampling is not greedy in disguise

    answers = list(stream_request(serving.cluster.addr, "stream", PROMPT, NEW, 60, **options))
    chunks = [a for a in answers[:-1] if isinstance(a, InferChunk)]
    reply = answers[-1]
    assert isinstance(reply, InferReply) and reply.ok, reply
    assert len(chunks) == len(answers) - 1 and chunks
    assert [t for c in chunks for t in c.tokens] == reply.tokens == want
    assert reply.finish_reason == "length"

    again = infer_request(serving.cluster.addr, "stream", PROMPT, NEW, 60, **options)
    assert again.ok and again.tokens == want  # same seed, same tokens, streamed or not

    greedy = _reference(w, GREEDY)
    stop = greedy[3]
    cut = greedy[: greedy.index(stop)]
    stopped = infer_request(serving.cluster.addr, "stream", PROMPT, NEW, 60, stop=[stop])
    assert stopped.ok and stopped.tokens == cut and stopped.finish_reason == "stop"
    serving.stop("stream")
