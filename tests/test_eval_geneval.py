"""GenEval: metadata checks, the official evaluator's folder layout, the toy rule scorer."""

import json
import re

import numpy as np
import pytest
import torch

from maskgrpo_ray.evaluation.geneval import (
    check_geneval_folder,
    score_toy,
    write_geneval_prompt,
)
from maskgrpo_ray.prompts.geneval_schema import (
    GENEVAL_CLASSES,
    GenEvalMetadataError,
    check_metadata,
)
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


def cells_of(*dots: tuple[str, int, int]) -> torch.Tensor:
    """A toy image's cells ``long [GRID, GRID]`` with the given ``(colour, row, col)`` dots."""
    cells = torch.zeros(GRID, GRID, dtype=torch.long)
    for colour, r, c in dots:
        cells[r, c] = toyworld.COLOUR_NAMES.index(colour) + 1
    return cells


def rule(cells: torch.Tensor, meta: dict) -> bool:
    return toyworld.toy_decide(cells, meta, CELL)[0]


def test_toy_detections_are_cell_boxes_with_score_one():
    # a red dot at row 1, col 3 of 4 x 4 cells of 4 px: the box [12, 4, 16, 8] in pixels
    dets = toyworld.toy_detections(cells_of(("red", 1, 3)), CELL)
    assert dets == {"dot": [(12.0, 4.0, 16.0, 8.0, 1.0, "red", frozenset({"right", "top"}))]}


def test_rule_on_the_other_tags():
    # two_object / color_attr: both colours present; position: include[1] relative to [0]
    objs = cells_of(("red", 1, 0), ("blue", 1, 3))
    two = {"tag": "two_object", "prompt": "p", "include": [{"class": "dot", "count": 1}] * 2}
    attr = {
        "tag": "color_attr",
        "prompt": "p",
        "include": [
            {"class": "dot", "count": 1, "color": "red"},
            {"class": "dot", "count": 1, "color": "blue"},
        ],
    }
    assert rule(objs, two)
    # GenEval judges a colour on the `count` most confident dots only: both dots score 1.0, and
    # the evaluator's np.argsort(scores)[::-1] of the two equal scores decides which one that
    # is (row-major order: red first, blue second); the other colour's clause then fails on it
    first = ["red", "blue"][int(np.argsort(np.array([1.0, 1.0]))[::-1][0])]
    other = {"red": "blue", "blue": "red"}[first]
    assert not rule(objs, attr)
    want = f"expected {other} dot>=1, found 0 {other}; and 1 {first}"
    assert toyworld.toy_decide(objs, attr, CELL) == (False, want)
    assert rule(objs, {**attr, "include": [{"class": "dot", "count": 1, "color": first}]})

    def pos(rel):
        return {
            "tag": "position",
            "prompt": "p",
            "include": [
                {"class": "dot", "count": 2},
                {"class": "dot", "count": 1, "position": [rel, 0]},
            ],
        }

    # the target group is both dots; the first dot (blue, at col 3) against itself has no
    # relation: GenEval's rule needs the relation to every object of the target group
    assert not rule(objs, pos("right of"))
    assert not rule(cells_of(("blue", 1, 3)), pos("right of"))  # no target: one dot of two
    # counting's exclude: three dots where "fewer than 3" is required
    count = {"tag": "counting", "prompt": "p", "include": [{"class": "dot", "count": 2}]}
    count["exclude"] = [{"class": "dot", "count": 3}]
    assert rule(objs, count)
    assert not rule(cells_of(("red", 1, 0), ("blue", 1, 3), ("red", 0, 0)), count)


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
    assert "\n" not in msg


def test_class_names_checked_only_when_asked():
    # GenEval's detector knows 80 COCO names (its object_names.txt); "teddy bear" is one,
    # "teddy" and the worlds' "dot" are not: refused for a real model's prompts only
    assert len(GENEVAL_CLASSES) == len(set(GENEVAL_CLASSES)) == 80
    ok = {
        "tag": "single_object",
        "prompt": "a teddy bear",
        "include": [{"class": "teddy bear", "count": 1}],
    }
    check_metadata(ok, "p:1", classes=GENEVAL_CLASSES)
    bad = {**ok, "exclude": [{"class": "teddy", "count": 2}]}
    with pytest.raises(GenEvalMetadataError) as err:
        check_metadata(bad, "p:2", classes=GENEVAL_CLASSES)
    msg = str(err.value)
    assert "p:2" in msg and "exclude[0].class" in msg and "'teddy'" in msg and "\n" not in msg
    check_metadata(toyworld.all_captions()[0].geneval_metadata(), "toy")  # the worlds: no check
    with pytest.raises(GenEvalMetadataError, match="'dot'"):
        check_metadata(toyworld.all_captions()[0].geneval_metadata(), "toy", GENEVAL_CLASSES)


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


def test_eval_checks_class_names_for_a_real_models_prompts_file(tmp_path):
    # the official evaluator scores a real model's images with its 80-class detector: a prompts
    # file naming "teddy" is refused before anything starts; the toy world's prompt set and a
    # world model (its own rule) keep their own class names
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.evaluation.runner import geneval_metadata
    from maskgrpo_ray.prompts.loading import load_prompt_records

    line = {
        "tag": "single_object",
        "include": [{"class": "teddy", "count": 1}],
        "prompt": "a teddy",
    }
    path = tmp_path / "meta.jsonl"
    path.write_text(json.dumps(line) + "\n")
    real = load_config("configs/showo_tiny_random.yaml")
    with pytest.raises(GenEvalMetadataError, match="include\\[0\\].class is 'teddy'"):
        geneval_metadata(load_prompt_records(str(path), "eval"), real)
    assert geneval_metadata(load_prompt_records(str(path), "eval"), load_config("configs/toy.yaml"))
    assert geneval_metadata(load_prompt_records("toy", "eval"), real)
    path.write_text(json.dumps({**line, "include": [{"class": "teddy bear", "count": 1}]}) + "\n")
    assert geneval_metadata(load_prompt_records(str(path), "eval"), real)
