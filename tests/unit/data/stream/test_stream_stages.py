"""A streamed corpus across a new stage (docs/stages.md): the loader restored from a checkpoint's position with the
stage's recipe. Each source keeps its own position, a new one starts at its beginning, a dropped one's position
stays and continues when a later stage names it again, and a new sequence length packs on from where each lane
stands: no token trained twice or skipped."""

from __future__ import annotations

import numpy as np
import pytest

from automodel_ckpt.data.stream.corpus import streamed_corpus
from automodel_ckpt.data.stream.loader import StreamLoader
from automodel_ckpt.data.stream.readers import DataError
from automodel_ckpt.data.stream.stream import StreamSettings
from tests.unit.data.stream.corpora import CharTokenizer, jsonl_files


def _loader(sources, seq_length=16, batch=4, lanes=2, dp_size=1, dp_rank=0) -> StreamLoader:
    corpus = streamed_corpus(sources=[{"path": str(p), "weight": w} for p, w in sources])
    return StreamLoader(corpus, corpus.list_shards(lanes=lanes), CharTokenizer(),
                        StreamSettings(seq_length=seq_length, seed=3, shuffle_buffer=8), global_batch_size=batch,
                        local_batch_size=batch // dp_size, dp_rank=dp_rank, dp_size=dp_size, lanes=lanes)


def _tokens(loader: StreamLoader, steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        _, micro = loader.next_batch()
        out += [t for mb in micro for t in mb.input_ids.reshape(-1).tolist()]
    return out


def _flat(loader: StreamLoader, steps: int, lanes: int) -> list[list[int]]:
    """Each lane's tokens in its order (sequence k is lane k mod lanes's), over ``steps`` steps."""
    per_lane: list[list[int]] = [[] for _ in range(lanes)]
    k = 0
    for _ in range(steps):
        _, micro = loader.next_batch()
        for row in (r for mb in micro for r in mb.input_ids.tolist()):
            per_lane[k % lanes] += row
            k += 1
    return per_lane


@pytest.fixture
def corpora(tmp_path):
    return jsonl_files(tmp_path / "a", files=4, rows=30), jsonl_files(tmp_path / "b", files=3, rows=25)


def test_a_new_sequence_length_packs_on_from_where_each_lane_stands(corpora):
    a, _ = corpora
    glob = a / "*.jsonl"
    straight = _flat(_loader([(glob, 1.0)], seq_length=16, batch=4), 9, lanes=2)
    before = _loader([(glob, 1.0)], seq_length=16, batch=4)
    head = _flat(before, 3, lanes=2)
    after = _loader([(glob, 1.0)], seq_length=24, batch=4)  # the next stage: longer sequences
    after.load_state_dict(before.state_dict())
    tail = _flat(after, 4, lanes=2)
    for lane in range(2):  # each lane's documents, carry-over and pending ones included, neither repeated nor lost
        joined = head[lane] + tail[lane]
        assert joined == straight[lane][:len(joined)] and len(tail[lane]) == 4 * 2 * 24
    again = _loader([(glob, 1.0)], seq_length=24, batch=4)  # its checkpoint resumes at its own length
    again.load_state_dict(after.state_dict())
    assert all(p.get("packed") == [6, 6 * 16] for p in after.state_dict()["positions"].values())
    assert _tokens(again, 2) == _tokens(after, 2)


def test_a_source_added_at_a_stage_starts_at_its_beginning_and_the_others_keep_their_place(corpora):
    a, b = corpora
    before = _loader([(a / "*.jsonl", 1.0)])
    _tokens(before, 3)
    state = before.state_dict()
    mixed = _loader([(a / "*.jsonl", 0.5), (b / "*.jsonl", 0.5)])
    mixed.load_state_dict(state)
    _tokens(mixed, 1)
    assert len(mixed.source_tokens) == 2 and mixed.source_tokens[0] > before.source_tokens[0]
    positions = mixed.state_dict()["positions"]
    assert all(len(p["sources"]) == 2 for p in positions.values())
    # the checkpoint of the stage resumes as itself: the same next step
    twin = _loader([(a / "*.jsonl", 0.5), (b / "*.jsonl", 0.5)])
    twin.load_state_dict(mixed.state_dict())
    assert _tokens(twin, 3) == _tokens(mixed, 3)
    _tokens(mixed, 20)  # the documents drawn before the stage packed first, then the blend's
    assert mixed.source_tokens[1] > 0


def test_a_dropped_source_keeps_its_position_and_continues_when_it_comes_back(corpora):
    a, b = corpora
    both = _loader([(a / "*.jsonl", 0.5), (b / "*.jsonl", 0.5)])
    _tokens(both, 4)
    only_a = _loader([(a / "*.jsonl", 1.0)])  # b dropped: weight 0, its slot and position kept
    only_a.load_state_dict(both.state_dict())
    kept = [p["sources"][1] for p in only_a.state_dict()["positions"].values()]
    _tokens(only_a, 3)
    state = only_a.state_dict()
    assert state["source_specs"][1][0] == [str(b / "*.jsonl")]
    _tokens(only_a, 20)
    b_tokens = only_a.source_tokens[1]
    _tokens(only_a, 3)
    assert only_a.source_tokens[1] == b_tokens  # never drawn once its pending documents are packed
    assert [p["sources"][1]["taken"] for p in state["positions"].values()] == [k["taken"] for k in kept]
    back = _loader([(b / "*.jsonl", 0.5), (a / "*.jsonl", 0.5)])  # named again (in another place of the list)
    back.load_state_dict(only_a.state_dict())
    assert [p["sources"][1]["taken"] for p in back.state_dict()["positions"].values()] == [k["taken"] for k in kept]
    _tokens(back, 20)
    assert back.source_tokens[1] > b_tokens  # it goes on from where it stood


def test_a_run_without_stages_resumes_its_stream_as_before(corpora):
    a, b = corpora
    sources = [(a / "*.jsonl", 0.6), (b / "*.jsonl", 0.4)]
    first = _loader(sources)
    _tokens(first, 2)
    state = first.state_dict()
    legacy = {k: v for k, v in state.items() if k not in ("source_specs", "seq_length")}  # written before stages
    for saved in (state, legacy):
        resumed = _loader(sources)
        resumed.load_state_dict(saved)
        assert "packed" not in next(iter(resumed.state_dict()["positions"].values()))
        assert _tokens(resumed, 2) == _tokens(_twin(sources, saved), 2)


def _twin(sources, state):
    twin = _loader(sources)
    twin.load_state_dict(state)
    return twin


@pytest.mark.parametrize("change,said", [
    (lambda s: s.update(source_specs=[["x"], None]), "its sources' globs"),
    (lambda s: s.update(source_specs=[[["../*"] * 300, None]]), "its sources' globs"),
    (lambda s: s.update(source_specs=[[["a"], "exe"]]), "its sources' globs"),
    (lambda s: s.update(seq_length=1), "its sequence length"),
    (lambda s: s.update(seq_length="16"), "its sequence length"),
    (lambda s: s.update(seq_length=24), "tokens to"),  # its lanes did not pack at 24
    (lambda s: next(iter(s["positions"].values())).update(packed=[10**6, 0]), "tokens to"),
    (lambda s: next(iter(s["positions"].values())).update(packed=[1]), "where its sequence length began"),
    (lambda s: s.update(shards=[[["a", "b", "c"]]]), "a shard record"),
])
def test_a_crafted_stage_position_is_one_line(corpora, change, said):
    a, _ = corpora
    first = _loader([(a / "*.jsonl", 1.0)])
    _tokens(first, 2)
    state = first.state_dict()
    change(state)
    with pytest.raises(DataError, match=said) as err:
        _loader([(a / "*.jsonl", 1.0)]).load_state_dict(state)
    assert "\n" not in str(err.value)


def test_the_blend_never_draws_a_dropped_source():
    from automodel_ckpt.data.stream.order import blend_pick

    picks = {blend_pick(7, doc, [0.0, 1.0, 0.0, 2.0, 0.0]) for doc in range(2000)}
    assert picks == {1, 3}
    assert np.isclose(sum(blend_pick(7, d, [1.0, 3.0]) for d in range(4000)) / 4000, 0.75, atol=0.03)


def test_the_worker_count_and_the_world_size_may_change_with_the_stage(corpora):
    a, b = corpora
    before = _loader([(a / "*.jsonl", 1.0)], batch=4)
    _tokens(before, 3)
    state = before.state_dict()
    sources = [(a / "*.jsonl", 0.5), (b / "*.jsonl", 0.5)]
    alone = _loader(sources, seq_length=24, batch=8)
    alone.load_state_dict(state)
    want = _tokens(alone, 3)
    ranks = []
    for rank in range(2):  # the stage on 2 ranks, each with 2 DataLoader workers
        loader = _loader(sources, seq_length=24, batch=8, dp_size=2, dp_rank=rank)
        loader.num_workers = 2
        loader.load_state_dict(loader.reshard_state(lambda r: state, 1, rank, 2))
        ranks.append([mb.input_ids for _ in range(3) for mb in loader.next_batch()[1]])
    got = []
    for step in range(3):  # global sequence k is rank k mod 2's
        for k in range(8):
            got += ranks[k % 2][step][k // 2].tolist()
    assert got == want
