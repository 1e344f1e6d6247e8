"""The version-aware buffer and the async drivers' logic, without vLLM.

Unit tests drive ``RolloutBuffer`` by hand. The long randomised runs execute the real driver code
(``run_separate``, ``run_colocate``, ``WeightGate``, ``PartialRollout``) on a virtual clock
against the benchmark's simulated servers and trainer, which only simulate durations (and abort
requests at random, as failure injection); the simulated trainer records every token that reaches
its loss.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import replace

import pytest

from tests.conftest import REPO
from trident.pipeline.buffer import GroupTicket, RolloutBuffer, StalenessError
from trident.pipeline.gate import WeightGate
from trident.pipeline.metrics import RolloutStats
from trident.pipeline.partial import PartialResponse, PartialRollout
from trident.pipeline.separate_async import run_separate
from trident.pipeline.sync import run_sync
from trident.rollout.engine import EngineError, SamplingParams
from trident.sample import Sample
from trident.telemetry.trace import Trace

sys.path.insert(0, str(REPO / "benchmarks"))
from async_pipeline import (  # noqa: E402
    LengthModel,
    SimConfig,
    SimFleet,
    SimServer,
    SimTiming,
    SimTrainer,
    run_virtual,
    sim_group_maker,
    simulate,
)


def group(ticket: GroupTicket, versions: list[int]) -> list[Sample]:
    """One sample whose response tokens carry ``versions``."""
    n = len(versions)
    return [
        Sample(
            id=f"g{ticket.index}",
            group_id=f"g{ticket.index}",
            token_ids=[1] + [2] * n,
            loss_mask=[0] + [1] * n,
            logprobs=[0.0] * (n + 1),
            versions=[-1] + versions,
            reward=1.0,
        )
    ]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # a hang is a failure


# ---------------------------------------------------------------------------------------------
# The buffer by hand


def test_admission_is_areals_capacity_rule() -> None:
    async def body() -> None:
        buf = RolloutBuffer(groups_per_step=2, max_staleness=1, max_running=8)
        tickets = [await buf.admit() for _ in range(4)]  # (η + 1)·B
        assert buf.capacity == 0 and [t.deadline for t in tickets] == [1, 1, 1, 1]
        for t in tickets[:2]:
            buf.put(t, group(t, [0]))
        await buf.next_batch()
        # batch 0 taken, weights still version 0: (v + η + 1 − t)·B − unconsumed = 2 − 2
        assert buf.capacity == 0
        buf.advance(1)
        assert buf.capacity == 2  # (1 + 1 + 1 − 1)·2 − 2
        ticket = await buf.admit()
        assert (ticket.version, ticket.deadline) == (1, 2)

    run(body())


def test_at_most_max_running_groups_generate_at_once() -> None:
    async def body() -> None:
        buf = RolloutBuffer(groups_per_step=4, max_staleness=2)  # max_running = B by default
        g = [await buf.admit() for _ in range(4)]
        assert buf.capacity == 0
        buf.put(g[0], group(g[0], [0]))
        assert buf.capacity == 1

    run(body())


def test_no_group_starts_while_a_whole_batch_is_waiting() -> None:
    """Freshness: with B finished groups waiting, a group started after the next sync is as
    useful and one version newer, so admission pauses even though η would allow more."""

    async def body() -> None:
        buf = RolloutBuffer(groups_per_step=2, max_staleness=3, max_running=8)
        g = [await buf.admit() for _ in range(3)]
        buf.put(g[0], group(g[0], [0]))
        assert buf.capacity == 8 - 3
        buf.put(g[1], group(g[1], [0]))
        assert buf.capacity == 0
        await buf.next_batch()  # the batch is taken: AReaL's rule again, (0 + 3 + 1 − 1)·2 − 1
        assert buf.capacity == 5
        buf.advance(1)
        assert buf.capacity == 7

    run(body())


def test_trainer_streams_finished_groups_but_never_leaves_a_due_group_behind() -> None:
    async def body() -> None:
        buf = RolloutBuffer(groups_per_step=2, max_staleness=1, max_running=4)
        g = [await buf.admit() for _ in range(4)]
        # step 0: the two groups that finish first are taken (streaming)
        buf.put(g[3], group(g[3], [0]))
        buf.put(g[2], group(g[2], [0]))
        assert {s.id for s in await buf.next_batch()} == {"g3", "g2"}
        buf.advance(1)
        # step 1: g0 and g1 are due now (deadline 1); two newer groups finishing first must wait
        new = [await buf.admit() for _ in range(2)]
        for t in new:
            buf.put(t, group(t, [1]))
        step1 = asyncio.create_task(buf.next_batch())
        await asyncio.sleep(0)
        assert not step1.done()
        buf.put(g[0], group(g[0], [0]))
        await asyncio.sleep(0)
        assert not step1.done()
        buf.put(g[1], group(g[1], [0]))
        assert {s.id for s in await step1} == {"g0", "g1"}
        assert dict(buf.stats.staleness) == {0: 2, 1: 2}

    run(body())


def test_eta_zero_admits_one_batch_and_waits_for_all_of_it() -> None:
    async def body() -> None:
        buf = RolloutBuffer(groups_per_step=3, max_staleness=0)
        g = [await buf.admit() for _ in range(3)]
        assert buf.capacity == 0
        buf.put(g[0], group(g[0], [0]))
        buf.put(g[1], group(g[1], [0]))
        batch = asyncio.create_task(buf.next_batch())
        await asyncio.sleep(0)
        assert not batch.done()
        buf.put(g[2], group(g[2], [0]))
        assert len(await batch) == 3
        assert buf.capacity == 0  # nothing may start on the old weights
        buf.advance(1)
        assert buf.capacity == 3

    run(body())


def test_a_token_older_than_eta_never_reaches_the_trainer() -> None:
    async def body() -> None:
        buf = RolloutBuffer(groups_per_step=1, max_staleness=1)
        for version in range(3):
            t = await buf.admit()
            buf.put(t, group(t, [version]))
            await buf.next_batch()
            buf.advance(version + 1)
        t = await buf.admit()
        buf.put(t, group(t, [3, 1]))  # a forged tag two versions old at version 3
        with pytest.raises(StalenessError, match="staleness 0..2"):
            await buf.next_batch()

    run(body())


def test_dropped_group_is_replaced_and_failures_reach_the_trainer() -> None:
    async def body() -> None:
        buf = RolloutBuffer(groups_per_step=1, max_staleness=0, total_groups=1)
        t = await buf.admit()
        buf.drop(t)
        t2 = await buf.admit()
        assert t2 is not None and t2.index != t.index
        buf.put(t2, group(t2, [0]))
        await buf.next_batch()
        buf.advance(1)
        assert await buf.admit() is None  # every group the run needs is done
        buf.fail(RuntimeError("server died"))
        with pytest.raises(RuntimeError, match="server died"):
            await buf.next_batch()

    run(body())


# ---------------------------------------------------------------------------------------------
# The drivers on a virtual clock (simulated durations)


def random_config(rng: random.Random) -> SimConfig:
    mode = rng.choice(["separate_async", "separate_async", "colocate_async"])
    eta = rng.randint(1, 4) if mode == "colocate_async" else rng.randint(0, 5)
    timing = SimTiming(
        step_s=rng.uniform(0.005, 0.05),
        per_seq_s=rng.uniform(0.0, 0.002),
        max_seqs=rng.choice([4, 16, 256]),
        train_fixed_s=rng.uniform(0.1, 5.0),
        train_per_token_s=rng.uniform(0, 1e-3),
        ranks=rng.choice([1, 8]),
        sync_s=rng.uniform(0.01, 3.0),
        reward_s=rng.uniform(0, 0.5),
        colocate_slowdown=rng.choice([1.0, 2.0]),
    )
    groups = rng.randint(1, 6)
    return SimConfig(
        mode=mode,
        eta=eta,
        servers=rng.randint(1, 6),
        groups_per_step=groups,
        max_running=rng.choice([None, groups * (eta + 1), rng.randint(1, 3 * groups)]),
        n=rng.randint(1, 4),
        steps=rng.randint(15, 40),
        lengths=LengthModel(rng.uniform(5, 200), rng.uniform(0.2, 1.5), rng.randint(50, 2000)),
        timing=timing,
        abort_rate=rng.choice([0.0, 0.0, rng.uniform(0.01, 0.5)]),
    )


@pytest.mark.parametrize("seed", range(30))
def test_randomised_runs_never_train_a_token_beyond_eta(seed: int) -> None:
    sc = random_config(random.Random(seed))
    result = simulate(sc)
    trainer, summary = result.trainer, result.summary
    assert len(trainer.batches) == sc.steps
    assert max(trainer.staleness) <= sc.eta and min(trainer.staleness) >= 0, trainer.staleness
    assert trainer.mislabelled == 0  # every tag is the version that generated the token
    if sc.mode == "colocate_async":
        assert set(trainer.staleness) <= {0, 1}
    # every admitted group is trained exactly once, whole
    trained = [sid for batch in trainer.batches for sid in batch]
    assert len(trained) == len(set(trained)) == sc.steps * sc.groups_per_step * sc.n
    assert summary["tokens_thrown_away"] == 0 and summary["dropped_groups"] == 0


def test_partial_rollout_neither_loses_nor_duplicates_tokens_or_samples() -> None:
    """Random aborts (failure injection) on top of the aborts of every weight update: each
    response still has exactly the length its prompt asks for, every sample is trained once."""
    sc = SimConfig(
        mode="separate_async",
        eta=2,
        servers=3,
        groups_per_step=4,
        n=3,
        steps=30,
        lengths=LengthModel(60, 1.0, 400),
        timing=SimTiming(step_s=0.02, train_fixed_s=1.0, sync_s=0.5, reward_s=0.1),
        abort_rate=0.2,
    )
    captured: list[Sample] = []

    async def body() -> tuple[RolloutStats, SimTrainer]:
        servers = [SimServer(f"sim://{i}", sc.lengths, sc.timing, sc.abort_rate) for i in range(3)]
        fleet = SimFleet(servers)
        trainer = SimTrainer(fleet, sc.timing)
        trace, stats = Trace(asyncio.get_running_loop().time), RolloutStats()
        gate = WeightGate(fleet)
        buf = RolloutBuffer(sc.groups_per_step, sc.eta, sc.groups_per_step * sc.steps)
        make_group = sim_group_maker(fleet, gate, trace, stats, sc.n, 400, sc.timing.reward_s)

        async def on_step(step: int, samples: list[Sample], metrics: dict) -> None:
            captured.extend(samples)

        await run_separate(buf, gate, make_group, trainer, sc.steps, trace, on_step)
        return stats, trainer

    stats, trainer = run_virtual(body())
    assert stats.aborted > 50 and stats.resumed > 0
    resumed_samples = [s for s in captured if s.metrics["resumes"] > 0]
    assert resumed_samples and any(len(set(s.versions[8:])) > 1 for s in resumed_samples)
    assert len({s.id for s in captured}) == len(captured) == sc.steps * sc.groups_per_step * sc.n
    for s in captured:
        expected = sc.lengths.draw(tuple(s.token_ids[:8]))
        assert s.num_response_tokens == expected, s.id
        assert s.token_ids[8:] == s.versions[8:]  # token id = generating version (simulation)
        assert s.versions[8:] == sorted(s.versions[8:])  # versions only move forward
    assert trainer.mislabelled == 0


def test_eta_zero_is_the_sync_schedule() -> None:
    """separate_async with η = 0 trains the same batches, hence the same losses, as the sync
    driver's schedule (``run_sync``) over the same simulated engine."""
    sc = SimConfig(
        eta=0,
        servers=2,
        groups_per_step=3,
        n=2,
        steps=8,
        lengths=LengthModel(40, 1.2, 300),
        timing=SimTiming(train_fixed_s=0.5, sync_s=0.2),
        abort_rate=0.0,
    )
    streamed = simulate(sc).trainer

    async def sync_loop() -> SimTrainer:
        fleet = SimFleet([SimServer(f"sim://{i}", sc.lengths, sc.timing) for i in range(2)])
        trainer = SimTrainer(fleet, sc.timing)
        trace, stats = Trace(asyncio.get_running_loop().time), RolloutStats()
        gate = WeightGate(fleet)
        make_group = sim_group_maker(fleet, gate, trace, stats, sc.n, 300, 0.05)
        buffer = RolloutBuffer(sc.groups_per_step, 0, sc.groups_per_step * sc.steps)

        steps: list[int] = []

        async def on_step(step: int, samples: list[Sample], metrics: dict) -> None:
            steps.append(step)

        await run_sync(buffer, gate, make_group, trainer, sc.steps, trace, on_step)
        assert steps == list(range(sc.steps))
        return trainer

    reference = run_virtual(sync_loop())
    assert streamed.batches == reference.batches
    assert streamed.losses == pytest.approx(reference.losses, rel=1e-12)
    assert set(streamed.staleness) == {0}


def test_separate_async_beats_sync_on_a_long_tail_in_simulation() -> None:
    """Behaviour, not timing of this machine: on the virtual clock, streaming with η = 2 needs
    less simulated time per trained sample than η = 0 and leaves the trainer idle less."""
    base = SimConfig(
        servers=4, groups_per_step=8, n=4, steps=12, lengths=LengthModel(100, 1.2, 2000)
    )
    sync = simulate(replace(base, eta=0)).summary
    streamed = simulate(replace(base, eta=2)).summary
    assert streamed["seconds_per_trained_sample"] < sync["seconds_per_trained_sample"]
    assert streamed["trainer_idle_fraction"] < sync["trainer_idle_fraction"]


def test_trace_is_chrome_json_with_every_stage(tmp_path) -> None:
    result = simulate(SimConfig(servers=2, groups_per_step=2, n=2, steps=4, eta=1))
    path = result.trace.write(tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = {e["name"] for e in events if e["ph"] == "X"}
    assert {"generate", "reward", "train", "weight sync", "queue wait"} <= spans
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"trainer", "reward", "rollout sim://0", "rollout sim://1"} <= processes


def test_partial_rollout_tags_each_segment_with_its_version() -> None:
    """One sample through two forced weight updates: three segments, three versions."""

    async def body() -> tuple[list[int], int]:
        timing = SimTiming(step_s=0.01, per_seq_s=0.0, prefill_ratio=0.0)
        server = SimServer("sim://0", LengthModel(300, 0.0, 300), timing)
        fleet = SimFleet([server])
        trainer = SimTrainer(fleet, timing)
        gate = WeightGate(fleet)
        partial = PartialRollout(fleet, gate, Trace(), RolloutStats())
        progress = PartialResponse()
        sample = partial.sample([0] * 8, SamplingParams(max_tokens=300), progress)
        task = asyncio.create_task(sample)
        for version in (1, 2):
            await asyncio.sleep(1.0)  # 100 tokens at 10 ms each
            await gate.update(version, lambda urls, v=version: trainer.sync_weights(v, urls))
        completion = await task
        assert completion.token_ids == completion.versions == progress.versions
        return progress.versions, progress.resumes

    versions, resumes = run_virtual(body())
    assert resumes == 2 and len(versions) == 300
    assert [versions.count(v) for v in (0, 1, 2)] == pytest.approx([100, 100, 100], abs=2)


def test_a_groups_requests_and_a_sessions_turns_stay_on_one_server() -> None:
    """``separate_async`` sends every sample of a group, and every segment resumed after an
    update, to the server the group started on (the prompt's prefix cache is there); an agent
    session's turns likewise. An environment's calls (no group record) each get responses of
    their own."""
    calls: list[tuple[str, int, int]] = []  # (server, prompt's first two tokens)

    class Logged(SimServer):
        async def generate(self, prompt_ids, params, session_id=None):
            calls.append((self.url, prompt_ids[0], prompt_ids[1]))
            return await super().generate(prompt_ids, params, session_id)

    async def body() -> list[list[int]]:
        timing = SimTiming(step_s=0.01, per_seq_s=0.0, prefill_ratio=0.0)
        fleet = SimFleet(
            [Logged(f"sim://{i}", LengthModel(100, 0.0, 100), timing) for i in range(3)]
        )
        trainer, gate = SimTrainer(fleet, timing), WeightGate(fleet)
        groups = [PartialRollout(fleet, gate, Trace(), RolloutStats(), []) for _ in range(3)]
        params = SamplingParams(n=4, max_tokens=100)
        tasks = [
            asyncio.create_task(g.generate([k, 0] + [0] * 6, params)) for k, g in enumerate(groups)
        ]
        await asyncio.sleep(0.5)  # half-way: every response is interrupted and resumed
        await gate.update(1, lambda urls: trainer.sync_weights(1, urls))
        await asyncio.gather(*tasks)
        env = PartialRollout(fleet, gate, Trace(), RolloutStats())
        lengths = []
        for turn in range(3):
            for session in (7, 8):
                prompt = [session, turn] + [0] * 6
                (c,) = await env.generate(prompt, SamplingParams(max_tokens=20), str(session))
                lengths.append(len(c.token_ids))
        return lengths

    lengths = run_virtual(body())
    for first in (0, 1, 2, 7, 8):  # three groups, two sessions
        mine = [url for url, a, _ in calls if a == first]
        assert len(set(mine)) == 1, (first, mine)
        assert len(mine) == (8 if first < 3 else 3)  # a group: 4 samples, each resumed once
    assert lengths == [20] * 6  # six calls, six responses (none handed back twice)
    assert len({url for url, a, _ in calls}) > 1  # the groups themselves spread


def test_a_dropped_connection_resumes_from_what_came_back() -> None:
    """A segment that fails in transport (the server closed a keep-alive socket) is retried from
    the tokens already received; a server that keeps failing fails the sample."""

    class Flaky(SimServer):
        failures = 0

        async def generate(self, prompt_ids, params, session_id=None):
            if self.failures:
                self.failures -= 1
                await asyncio.sleep(0.1)
                raise EngineError(f"{self.url}: ReadError")
            return await super().generate(prompt_ids, params, session_id)

    async def body(failures: int) -> tuple[int, RolloutStats]:
        server = Flaky("sim://0", LengthModel(50, 0.0, 50), SimTiming(step_s=0.01))
        server.failures = failures
        fleet = SimFleet([server])
        stats = RolloutStats()
        partial = PartialRollout(fleet, WeightGate(fleet), Trace(), stats)
        completion = await partial.sample(
            [0] * 8, SamplingParams(max_tokens=100), PartialResponse()
        )
        return len(completion.token_ids), stats

    length, stats = run_virtual(body(2))
    assert length == 50 and stats.failed_segments == 2
    with pytest.raises(EngineError):
        run_virtual(body(10))
