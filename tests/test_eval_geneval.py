"""GenEval: metadata checks, the official evaluator's folder layout, the toy rule scorer."""

import json
import re

import pytest
import torch

from maskgrpo_ray.evaluation.geneval import (
    check_geneval_folder,
    evaluate_objects,
    relations,
    score_toy,
    write_geneval_prompt,
)
from maskgrpo_ray.geneval_schema import GenEvalMetadataError, check_metadata
from maskgrpo_ray.worlds.toy import world as toyworld
from maskgrpo_ray.worlds.toy.rewards import judge

GRID, CELL = 4, 4


def scenes(n: int, seed: int) -> tuple[torch.Tensor, list[toyworld.Caption]]:
    """``n`` toy images (a quarter correct, the rest corrupted each way) and their captions."""
    g = torch.Generator().manual_seed(seed)
    caps = toyworld.all_captions()
    kinds = [None, "count", "place", "extra"]
    cells, chosen = [], []
    for i in range(n):
        cap = caps[int(torch.randint(len(caps), (1,), generator=g))]
        cells.append(toyworld.render_scene(cap, GRID, g, corrupt=kinds[i % 4]))
        chosen.append(cap)
    images = toyworld.decode_palette(torch.stack(cells).view(n, -1), GRID, CELL)
    return images, chosen


def test_toy_rule_equals_the_toy_reward_correctness():
    # the toy metadata's include (>= count dots of the colour, all in the half) and exclude
    # (fewer than count + 1 dots of any colour) together say: exactly count dots, all of the
    # colour, all in the half -- the toy reward's `correct`
    images, caps = scenes(200, seed=3)
    got = score_toy(images, [c.geneval_metadata() for c in caps], GRID)["geneval"]
    want = judge(images, [c.text for c in caps], GRID)["correct"]
    assert torch.equal(got, want)
    assert 0.15 < float(got.mean()) < 0.5  # both outcomes occur (a quarter are correct)


def test_toy_metadata_is_geneval_metadata():
    for cap in toyworld.all_captions():
        meta = cap.geneval_metadata()
        check_metadata(meta, "toy")
        assert meta["tag"] == ("single_object" if cap.count == 1 else "counting")
        assert meta["prompt"] == cap.text


def dot(colour: str, r: int, c: int) -> dict:
    regions = {p for p in toyworld.POSITIONS if toyworld.region_mask(p, GRID)[r, c]}
    return {"color": colour, "xy": (c + 0.5, r + 0.5), "region": regions}


def test_rule_on_the_other_tags():
    # two_object / color_attr: both colours present; position: include[1] relative to [0]
    red_left, blue_right = dot("red", 1, 0), dot("blue", 1, 3)
    objs = {"dot": [red_left, blue_right]}
    two = {"tag": "two_object", "prompt": "p", "include": [{"class": "dot", "count": 1}] * 2}
    attr = {
        "tag": "color_attr",
        "prompt": "p",
        "include": [
            {"class": "dot", "count": 1, "color": "red"},
            {"class": "dot", "count": 1, "color": "blue"},
        ],
    }
    assert evaluate_objects(objs, two) and evaluate_objects(objs, attr)
    attr_wrong = {**attr, "include": [{**attr["include"][0], "color": "green"}, attr["include"][1]]}
    assert not evaluate_objects(objs, attr_wrong)

    def pos(rel):
        return {
            "tag": "position",
            "prompt": "p",
            "include": [
                {"class": "dot", "count": 1, "color": "red"},
                {"class": "dot", "count": 1, "color": "blue", "position": [rel, 0]},
            ],
        }

    assert evaluate_objects(objs, pos("right of"))  # blue is right of red
    assert not evaluate_objects(objs, pos("left of"))
    assert not evaluate_objects({"dot": [blue_right]}, pos("right of"))  # no target
    # counting's exclude: three dots where "fewer than 3" is required
    count = {"tag": "counting", "prompt": "p", "include": [{"class": "dot", "count": 2}]}
    count["exclude"] = [{"class": "dot", "count": 3}]
    assert evaluate_objects(objs, count)
    assert not evaluate_objects({"dot": [red_left, blue_right, dot("red", 0, 0)]}, count)


def test_relations_follow_the_official_half_unit_rule():
    assert relations((0, 0), (1, 0)) == {"left of"}
    assert relations((0, 0), (1, 1)) == {"left of", "above"}  # 45 degrees: both pass 0.5
    assert relations((0, 0), (1, 3)) == {"above"}  # x component 0.32 < 0.5
    assert relations((2, 2), (2, 2)) == set()


@pytest.mark.parametrize(
    "meta, field",
    [
        ({"prompt": "a photo of a cat", "include": [{"class": "cat", "count": 1}]}, "'tag'"),
        ({"tag": "shapes", "prompt": "x", "include": [{"class": "cat", "count": 1}]}, "'tag'"),
        ({"tag": "counting", "prompt": "x", "include": []}, "'include'"),
        ({"tag": "counting", "prompt": "x", "include": [{"class": "cat"}]}, "include[0].count"),
        (
            {
                "tag": "position",
                "prompt": "x",
                "include": [
                    {"class": "a", "count": 1},
                    {"class": "b", "count": 1, "position": ["near", 0]},
                ],
            },
            "include[1].position",
        ),
    ],
)
def test_bad_metadata_names_where_field_and_fix(meta, field):
    with pytest.raises(GenEvalMetadataError) as err:
        check_metadata(meta, "prompts.jsonl:7")
    msg = str(err.value)
    assert "prompts.jsonl:7" in msg and field in msg and "maskgrpo prompts make" in msg


def test_folder_layout_from_a_ten_line_metadata_file(tmp_path):
    # what the official evaluate_images.py reads: IMAGEDIR/<digits>/metadata.jsonl (json.load
    # of one object) and IMAGEDIR/<digits>/samples/<digits>.png
    caps = toyworld.all_captions()[:10]
    lines = [json.dumps(c.geneval_metadata()) for c in caps]
    (tmp_path / "meta.jsonl").write_text("\n".join(lines) + "\n")
    metas = [json.loads(x) for x in (tmp_path / "meta.jsonl").read_text().splitlines()]
    root = tmp_path / "images"
    images, _ = scenes(10 * 3, seed=0)
    for i, meta in enumerate(metas):
        write_geneval_prompt(root, i, meta, images[3 * i : 3 * i + 3])
    assert check_geneval_folder(root, prompts=10, samples_per_prompt=3) == []
    folders = sorted(p.name for p in root.iterdir())
    assert folders == [f"{i:05d}" for i in range(10)]
    for i, folder in enumerate(sorted(root.iterdir())):
        with open(folder / "metadata.jsonl") as fp:
            assert json.load(fp) == metas[i]  # the evaluator's own read
        names = sorted(p.name for p in (folder / "samples").iterdir())
        assert names == ["00000.png", "00001.png", "00002.png"]
        assert all(re.match(r"\d+\.png", n) for n in names)
    # and the check notices what the evaluator would miss
    (root / "00004" / "samples" / "00002.png").unlink()
    (root / "00007" / "metadata.jsonl").write_text(json.dumps({"prompt": "x"}))
    problems = check_geneval_folder(root, prompts=10, samples_per_prompt=3)
    assert len(problems) == 2 and "00004" in problems[0] and "00007" in problems[1]
