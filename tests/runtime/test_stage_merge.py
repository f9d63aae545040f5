"""Merging pipeline stages' layout descriptions into one layout file with `pp` (runtime/layout/stage_merge.py), and the
stage checks a layout with `pp` gets when it is read (runtime/layout/stages.py): one-line refusals."""

from __future__ import annotations

import json

import pytest

from weightplan.runtime import LayoutError, merge_stage_layouts, read_trainer_layout
from weightplan.runtime.layout.layout_file import write_layout_object


def _stage(world: int, ranks: list[int], names: list[str], shape=(8, 4)) -> dict:
    """A stage's description as describe_layout gives it: its tensors Shard(0) on a 1-D mesh of the stage's ranks."""
    return {"format": "weightplan-trainer-layout", "version": 1, "world_size": world,
            "meshes": [{"shape": [len(ranks)], "ranks": ranks}],
            "tensors": {n: {"shape": list(shape), "dtype": "float32", "mesh": 0, "placements": ["Shard(0)"]} for n in names}}


FIRST = ["model.embed_tokens.weight", "model.layers.0.mlp.w", "model.layers.1.mlp.w"]
LAST = ["model.layers.2.mlp.w", "model.norm.weight", "lm_head.weight"]


def test_stages_merge_into_one_layout_with_pp_in_stage_order(tmp_path):
    # every rank of a stage sends its description: duplicates collapse, order follows the ranks
    merged = merge_stage_layouts([_stage(4, [2, 3], LAST), _stage(4, [0, 1], FIRST), _stage(4, [2, 3], LAST)])
    assert merged["pp"] == 2 and merged["world_size"] == 4
    assert merged["meshes"] == [{"shape": [2], "ranks": [0, 1]}, {"shape": [2], "ranks": [2, 3]}]
    assert {n: e["mesh"] for n, e in merged["tensors"].items()} == {**dict.fromkeys(FIRST, 0), **dict.fromkeys(LAST, 1)}
    path = write_layout_object(merged, tmp_path / "layout.json")
    assert read_trainer_layout(path).pp == 2
    assert json.loads(path.read_text()) == merged


def test_a_tied_embedding_on_the_first_and_last_stage_is_one_replicated_tensor():
    tied = "model.embed_tokens.weight"
    merged = merge_stage_layouts([_stage(4, [0, 1], FIRST), _stage(4, [2, 3], LAST[:2] + [tied])])
    entry = merged["tensors"][tied]
    assert entry["placements"] == ["Replicate()", "Shard(0)"]
    assert merged["meshes"][entry["mesh"]] == {"shape": [2, 2], "ranks": [[0, 1], [2, 3]]}


def test_a_single_stage_is_an_ordinary_layout():
    one = _stage(2, [0, 1], FIRST + LAST)
    assert merge_stage_layouts([one, one]) == one


@pytest.mark.parametrize("stages, message", [
    ([_stage(4, [0, 1], FIRST), _stage(4, [1, 2, 3], LAST)],
     r"two different stage descriptions both place tensors on trainer rank 1, so the stages overlap"),
    ([_stage(4, [0, 2], FIRST), _stage(4, [1, 3], LAST)],
     r"stage 0 of 2 holds trainer ranks \[0, 2\]; pipeline stages are equal blocks of consecutive ranks in stage order .* "
     r"stage 0 would be ranks 0\.\.1"),
    ([_stage(6, [0, 1], FIRST), _stage(6, [2, 3, 4, 5], LAST)], r"stage 0 of 2 holds trainer ranks 0\.\.1; .* ranks 0\.\.2"),
    ([_stage(4, [0, 1], FIRST), _stage(4, [2, 3], ["model.layers.1.mlp.v", *LAST])],
     r"layer 1 has tensors on stages \[0, 1\]; each layer lives on one pipeline stage"),
    ([_stage(4, [0, 1], FIRST), _stage(4, [2, 3], ["model.layers.3.mlp.w", "lm_head.weight"])],
     r"no pipeline stage holds layer 2 \(stage 0: layers 0\.\.1, stage 1: layers 3\.\.3\); every layer up to 3 must be on one stage"),
    ([_stage(4, [0, 1], ["model.layers.2.mlp.w"]), _stage(4, [2, 3], ["model.layers.0.mlp.w", "model.layers.1.mlp.w"])],
     r"stage 0 holds layers past stage 1's \(stage 0: layers 2\.\.2, stage 1: layers 0\.\.1\)"),
    ([_stage(6, [0, 1], FIRST), _stage(6, [2, 3], ["model.layers.2.mlp.w"]), _stage(6, [4, 5], ["lm_head.weight", FIRST[0]])],
     None),  # a tied embedding on the first and last of three stages: fine
    ([_stage(4, [0, 1], FIRST), _stage(4, [2, 3], LAST + [FIRST[0]], shape=(16, 4))],
     r"stages 0 and 1 both hold tensor 'model\.embed_tokens\.weight' but lay it out differently"),
    ([_stage(4, [0, 1], FIRST), _stage(2, [0, 1], LAST)], r"stage descriptions give world_size 2 and 4"),
])
def test_inconsistent_stages_are_refused_in_one_line(stages, message):
    if message is None:
        assert merge_stage_layouts(stages)["pp"] == 3
        return
    with pytest.raises(LayoutError, match=message) as caught:
        merge_stage_layouts(stages, "the stages")
    assert "\n" not in str(caught.value) and "the stages: " in str(caught.value)


def test_a_layer_tensor_on_two_stages_in_a_file_is_refused(tmp_path):
    data = merge_stage_layouts([_stage(4, [0, 1], FIRST), _stage(4, [2, 3], LAST)])
    data["meshes"].append({"shape": [2, 2], "ranks": [[0, 1], [2, 3]]})
    data["tensors"]["model.layers.1.mlp.w"] = {"shape": [8, 4], "dtype": "float32", "mesh": 2,
                                               "placements": ["Replicate()", "Shard(0)"]}
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(data))
    with pytest.raises(LayoutError, match=r"tensor 'model\.layers\.1\.mlp\.w' is on pipeline stages \[0, 1\]; a tensor lives "
                                          r"on one stage \(only a tied embedding"):
        read_trainer_layout(path)
    data["pp"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(LayoutError, match=r"pp 3 does not divide world_size 4"):
        read_trainer_layout(path)
    data["pp"] = "2"
    path.write_text(json.dumps(data))
    with pytest.raises(LayoutError, match=r'"pp" is 2, not a number of pipeline stages in 2\.\.world_size \(4\)'):
        read_trainer_layout(path)


def test_pp_alone_stages_of_plain_tensors_are_held_by_their_own_rank():
    """`pp=3` without FSDP: each stage is one rank holding plain tensors, described as whole on that rank only."""
    import torch

    from weightplan.runtime.layout.layout_file import describe_layout

    stages = [{"model.embed_tokens.weight": torch.zeros(8, 4), "model.layers.0.w": torch.zeros(4)},
              {"model.layers.1.w": torch.zeros(4)}, {"model.layers.2.w": torch.zeros(4), "lm_head.weight": torch.zeros(8, 4)}]
    merged = merge_stage_layouts([describe_layout(t, world_size=3, plain_ranks=[r]) for r, t in enumerate(stages)])
    assert merged["pp"] == 3
    assert {n: merged["meshes"][e["mesh"]]["ranks"] for n, e in merged["tensors"].items()} == {
        "model.embed_tokens.weight": [0], "model.layers.0.w": [0], "model.layers.1.w": [1], "model.layers.2.w": [2],
        "lm_head.weight": [2]}
