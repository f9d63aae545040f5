"""Bad --trainer-layout files are refused before tracing with one line naming the tensor (or mesh) and the fix."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError
from weightplan.compiler.frontend.trainer_formats import TrainerFormat, trainer_specs
from weightplan.compiler.layouts import parse_trainer
from weightplan.runtime import LayoutError

from ..conftest import config_dir

MODEL = config_dir("tiny-llama")
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def specs():
    return trainer_specs(MODEL, TrainerFormat.HF, torch.bfloat16)


@pytest.fixture
def good(specs):
    """A valid layout: every tensor Shard(0) over ranks 0 and 1."""
    return {
        "format": "weightplan-trainer-layout", "version": 1, "world_size": 2,
        "meshes": [{"shape": [2], "ranks": [0, 1]}],
        "tensors": {s.name: {"shape": list(s.shape), "dtype": s.dtype, "mesh": 0, "placements": ["Shard(0)"]} for s in specs},
    }


def _bind(tmp_path, data, specs, fmt=TrainerFormat.HF):
    path = tmp_path / "layout.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return parse_trainer("fsdp=1", path, fmt).bind(specs)


def test_a_good_file_binds_as_the_shorthand(tmp_path, good, specs):
    layout = _bind(tmp_path, good, specs)
    assert layout.token == "fsdp2" and layout.ranks == 2


def _edit(good, change):
    data = copy.deepcopy(good)
    change(data)
    return data


CASES = [
    ("overlapping shards", lambda d: d["meshes"].__setitem__(0, {"shape": [2], "ranks": [1, 1]}),
     "mesh 0 lists trainer rank 1 at two coordinates, so its shards would overlap"),
    ("gap in the mesh", lambda d: d["meshes"].__setitem__(0, {"shape": [2, 2], "ranks": [[0, 1], [2]]}),
     r"mesh 0: ranks \[\[0, 1\], \[2\]\] do not fill the mesh shape \[2, 2\] with integers, so part of its tensors would have no holder"),
    ("wrong total shape", lambda d: d["tensors"][EMBED].__setitem__("shape", [319, 64]),
     rf"tensor '{EMBED}' has global shape \[319, 64\], the trainer tensor is \[320, 64\]"),
    ("unknown tensor", lambda d: d["tensors"].__setitem__("model.nope.weight", d["tensors"][EMBED]),
     "tensor 'model.nope.weight' is not a trainer tensor of --trainer-format hf"),
    ("missing tensors", lambda d: d["tensors"].pop(EMBED),
     rf"has no entry for trainer tensor '{EMBED}'; every trainer tensor of --trainer-format hf needs one"),
    ("unknown placement", lambda d: d["tensors"][EMBED].__setitem__("placements", ["Partial(sum)"]),
     rf"tensor '{EMBED}': unknown placement 'Partial\(sum\)'; use Shard\(d\), Replicate\(\) or _StridedShard"),
    ("placement count", lambda d: d["tensors"][EMBED].__setitem__("placements", ["Shard(0)", "Shard(1)"]),
     rf"tensor '{EMBED}': 2 placements for a 1-D mesh"),
    ("shard dim out of range", lambda d: d["tensors"][EMBED].__setitem__("placements", ["Shard(2)"]),
     rf"tensor '{EMBED}': placement Shard\(2\) on a 2-D tensor"),
    ("strided shard that is no box", lambda d: d["tensors"][EMBED].__setitem__("placements", ["_StridedShard(0, split_factor=2)"]),
     rf"tensor '{EMBED}': placements \(_StridedShard\(0, split_factor=2\)\) give the rank at mesh coordinate \(0,\) a non-contiguous part of dim 0"),
    ("rank outside world_size", lambda d: d["meshes"].__setitem__(0, {"shape": [2], "ranks": [0, 2]}),
     "mesh 0 names trainer rank 2, outside world_size 2; mesh rank ids must be global trainer ranks"),
    ("rank in no mesh", lambda d: d.__setitem__("world_size", 3),
     "trainer rank 2 of world_size 3 holds no tensor"),
    ("dtype mismatch", lambda d: d["tensors"][EMBED].__setitem__("dtype", "float32"),
     rf"tensor '{EMBED}' is float32, the trainer tensor is bfloat16 \(masters follow --trainer-dtype\); pass the matching --trainer-dtype"),
    ("unknown mesh", lambda d: d["tensors"][EMBED].__setitem__("mesh", 3),
     rf"tensor '{EMBED}' names mesh 3; the file has meshes 0..0"),
    ("not a layout file", lambda d: d.__setitem__("format", "something-else"),
     "is not a weightplan trainer layout"),
    ("pp over tensors on every rank", lambda d: d.__setitem__("pp", 2),
     r"tensor '[^']+' is on pipeline stages \[0, 1\]; a tensor lives on one stage \(only a tied embedding"),
    ("pp that is not a stage count", lambda d: d.__setitem__("pp", 1), r'"pp" is 1, not a number of pipeline stages in 2\.\.world_size'),
]


@pytest.mark.parametrize("what,change,message", CASES, ids=[c[0] for c in CASES])
def test_inconsistent_layout_is_refused_naming_the_culprit(tmp_path, good, specs, what, change, message):
    with pytest.raises(LayoutError, match=message):
        _bind(tmp_path, _edit(good, change), specs)


def test_bad_json_is_refused(tmp_path, specs):
    with pytest.raises(LayoutError, match=r"is not valid JSON: Expecting .* at line 1 column"):
        _bind(tmp_path, '{"format": ', specs)


def test_a_tensor_listed_twice_is_refused(tmp_path, good, specs):
    text = json.dumps(good)
    entry = json.dumps(good["tensors"][EMBED])
    text = text.replace('"tensors": {', f'"tensors": {{"{EMBED}": {entry}, ', 1)
    with pytest.raises(LayoutError, match=f"'{EMBED}' appears twice"):
        _bind(tmp_path, text, specs)


def test_trainer_and_trainer_layout_are_exclusive(tmp_path, good):
    (tmp_path / "l.json").write_text(json.dumps(good))
    with pytest.raises(ModelConfigError, match="either --trainer or --trainer-layout"):
        parse_trainer("fsdp=2", tmp_path / "l.json")


def test_compile_refuses_before_tracing_and_writes_nothing(tmp_path, good):
    bad = _edit(good, lambda d: d["tensors"][EMBED].__setitem__("shape", [1, 64]))
    (tmp_path / "l.json").write_text(json.dumps(bad))
    out = tmp_path / "never.plan"
    with pytest.raises(LayoutError, match=f"tensor '{EMBED}' has global shape"):
        compile_plan(CompileOptions(str(MODEL), output=out, trainer_layout=tmp_path / "l.json"))
    assert not out.exists()


@pytest.mark.parametrize("what,change,message", [
    ("more ranks than a plan holds", lambda d: d.__setitem__("world_size", 4097), r"\"world_size\" \(an integer in 1..4096"),
    ("huge split factor", lambda d: d["tensors"][EMBED].__setitem__("placements", ["_StridedShard(0, split_factor=99999999999999)"]),
     r"unknown placement '_StridedShard\(0, split_factor=9+\)'; use .* with k in 1..4096"),
])
def test_sizes_beyond_the_plan_limits_are_refused_before_compiling(tmp_path, good, specs, what, change, message):
    with pytest.raises(LayoutError, match=message) as info:
        _bind(tmp_path, _edit(good, change), specs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind,message", [
    ("fifo", "is not a regular file"), ("device", "is not a regular file"), ("not utf-8", "is not UTF-8 text"),
    ("deep nesting", "nested too deeply"), ("5000-digit integer", "is not valid JSON: Exceeds the limit"),
])
def test_files_that_are_not_layouts_are_one_line_without_reading_them_whole(tmp_path, specs, kind, message):
    import os

    path = tmp_path / "layout.json"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would block without O_NONBLOCK
    elif kind == "device":
        path = "/dev/zero"  # never ends: read unbounded, it fills memory
    else:
        path.write_bytes({"not utf-8": b'{"format": "\xff"}', "deep nesting": b"[" * 100_000 + b"]" * 100_000,
                          "5000-digit integer": b'{"world_size": ' + b"9" * 5000 + b"}"}[kind])
    with pytest.raises(LayoutError, match=message) as info:
        parse_trainer("fsdp=1", path, TrainerFormat.HF).bind(specs)
    assert "\n" not in str(info.value)
