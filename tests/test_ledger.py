"""The token ledger balances samples and response tokens: generated = trained + waiting +
discarded by reason, per step and over a run continued from its checkpointed counts; a sample
lost or a token miscounted stops the run with a sentence saying what does not balance."""

from __future__ import annotations

import pytest

from trident.pipeline.ledger import DISCARD_REASONS, Ledger, LedgerError
from trident.sample import Sample


def sample(i: int, prompt: int, response: int, versions: list[int] | None = None) -> Sample:
    n = prompt + response
    return Sample(
        id=f"s{i}",
        group_id=f"g{i // 2}",
        token_ids=list(range(n)),
        loss_mask=[0] * prompt + [1] * response,
        logprobs=[0.0] * n,
        versions=[-1] * prompt + (versions or [0] * response),
    )


def test_samples_and_tokens_balance_per_step_and_across_a_resume():
    a, b, c, d = sample(0, 5, 7), sample(1, 5, 3), sample(2, 4, 0), sample(3, 4, 9)
    ledger = Ledger()
    # step 0: four generated; one trained, one untrainable (no model token), two waiting
    m = ledger.account([a, b, c, d], [a], [("untrainable", c)], [b, d], steps=1)
    assert m["ledger/generated_samples"] == 4 and m["ledger/generated_tokens"] == 19
    assert m["ledger/trained_samples"] == 1 and m["ledger/trained_tokens"] == 7
    assert m["ledger/discarded/untrainable_samples"] == 1
    assert m["ledger/discarded/untrainable_tokens"] == 0
    assert all(f"ledger/discarded/{r}_tokens" in m for r in DISCARD_REASONS)
    assert m["ledger/run/waiting_samples"] == 2 and m["ledger/run/waiting_tokens"] == 12

    # a resumed run continues from the checkpointed counts: a response generated in segments
    # under versions 1 and 2 (interrupted by a weight update) counts its 6 tokens once
    resumed = Ledger(ledger.state_dict())
    e, f = sample(4, 5, 6, versions=[1, 1, 1, 2, 2, 2]), sample(5, 5, 2)
    m = resumed.account([e, f], [b, d], [("no_signal", f)], [e], steps=2)
    assert m["ledger/generated_tokens"] == 8 and m["ledger/trained_tokens"] == 12
    assert m["ledger/discarded/no_signal_tokens"] == 2
    assert m["ledger/run/generated_tokens"] == 27 and m["ledger/run/trained_tokens"] == 19
    assert m["ledger/run/waiting_samples"] == 1 and m["ledger/run/waiting_tokens"] == 6
    assert m["ledger/run/generated_tokens"] == m["ledger/run/trained_tokens"] + m[
        "ledger/run/waiting_tokens"
    ] + sum(m[f"ledger/run/discarded/{r}_tokens"] for r in DISCARD_REASONS)


def test_a_token_imbalance_is_an_error_naming_the_counts():
    a, b = sample(0, 5, 7), sample(1, 5, 3)
    ledger = Ledger()
    ledger.account([a, b], [], [], [a, b], steps=0)
    # the same two samples, but one reaches the trainer with a longer response than generated
    a.loss_mask[0] = 1  # a prompt token turned into a response token on the way
    with pytest.raises(LedgerError) as e:
        Ledger(ledger.state_dict()).account([], [a, b], [], [], steps=1)
    assert str(e.value) == (
        "token ledger does not balance after 1 steps: 10 response tokens generated, 11 trained, "
        "0 discarded (0 infra_error, 0 untrainable, 0 no_signal), but 0 waiting in the buffer "
        "instead of -1"
    )


def test_a_lost_sample_is_an_error_naming_the_counts():
    a, b, c = sample(0, 5, 7), sample(1, 5, 3), sample(2, 5, 4)
    with pytest.raises(LedgerError, match=r"3 samples generated, 1 trained, 1 discarded .*"
                       r"but 0 waiting in the buffer instead of 1"):  # fmt: skip
        Ledger().account([a, b, c], [a], [("infra_error", b)], [], steps=1)
