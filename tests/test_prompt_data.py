"""Prompt files with metadata (txt, json, jsonl, parquet), deduplication with counts, errors
that name the file, the field and the fix, the GenEval-style generator and its command."""

import argparse
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maskgrpo_ray import prompts_cli
from maskgrpo_ray.data import PromptDataError, load_prompt_records, load_prompts
from maskgrpo_ray.evaluation.geneval import check_metadata
from maskgrpo_ray.prompt_gen import OBJECTS, article, make_geneval_prompts, plural

META = [
    {"tag": "counting", "include": [{"class": "cup", "count": 2}], "prompt": "a photo of two cups"},
    {
        "tag": "colors",
        "include": [{"class": "car", "count": 1, "color": "pink"}],
        "prompt": "a photo of a pink car",
    },
]


def test_every_format_keeps_text_and_metadata(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(m) + "\n" for m in META))
    (tmp_path / "p.json").write_text(json.dumps([{"caption": "a cat", "id": 7}, "a dog"]))
    (tmp_path / "p.txt").write_text("a cat\n  a   dog \n")
    pq.write_table(
        pa.table({"TEXT": ["a cat", "a dog"], "AESTHETIC_SCORE": [6.5, 5.0]}),
        tmp_path / "p.parquet",
    )
    jl = load_prompt_records(str(tmp_path / "p.jsonl"))
    assert jl.texts == [m["prompt"] for m in META]
    assert jl.records[0].meta == {"tag": "counting", "include": [{"class": "cup", "count": 2}]}
    assert jl.records[1].source.endswith("p.jsonl:2")
    js = load_prompt_records(str(tmp_path / "p.json"))
    assert js.texts == ["a cat", "a dog"] and js.records[0].meta == {"id": 7}
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog"]  # whitespace normalised
    pa_ = load_prompt_records(str(tmp_path / "p.parquet"), column="TEXT")
    assert pa_.texts == ["a cat", "a dog"] and pa_.records[0].meta == {"AESTHETIC_SCORE": 6.5}


def test_toy_prompt_set_carries_geneval_metadata():
    loaded = load_prompt_records("toy", "eval")
    assert loaded.records and all(r.meta and r.meta["tag"] for r in loaded.records)
    for r in loaded.records:
        check_metadata({**r.meta, "prompt": r.text}, r.source)


def test_blanks_and_duplicates_are_dropped_and_counted(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\na cat\na  cat\na dog\n   \n")
    loaded = load_prompt_records(str(tmp_path / "p.txt"))
    assert loaded.texts == ["a cat", "a dog"]
    assert loaded.dropped == {"blank": 2, "duplicate": 2}


@pytest.mark.parametrize(
    "name, content, kwargs, needles",
    [
        ("empty.txt", "\n \n", {}, ["empty.txt", "holds no prompts", "2 blank", "data.prompts"]),
        ("bad.jsonl", '{"prompt": "a"}\n{oops\n', {}, ["bad.jsonl:2", "not valid JSON"]),
        (
            "keys.jsonl",
            '{"text": "a cat"}\n',
            {},
            ["keys.jsonl:1", "['text']", "data.prompt_column"],
        ),
        ("p.xml", "<a/>", {}, ["p.xml", ".parquet"]),
        (
            "untagged.jsonl",
            json.dumps(META[0]) + "\n" + json.dumps({"prompt": "a cat"}) + "\n",
            {"require_tag": True},
            ["untagged.jsonl:2", "field 'tag'", "color_attr"],
        ),
    ],
)
def test_bad_files_name_file_field_and_fix(tmp_path, name, content, kwargs, needles):
    (tmp_path / name).write_text(content)
    with pytest.raises(PromptDataError) as err:
        load_prompt_records(str(tmp_path / name), **kwargs)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_parquet_without_the_column_lists_its_columns(tmp_path):
    pq.write_table(pa.table({"TEXT": ["a"], "URL": ["u"]}), tmp_path / "c.parquet")
    with pytest.raises(PromptDataError) as err:
        load_prompt_records(str(tmp_path / "c.parquet"))
    msg = str(err.value)
    assert "c.parquet" in msg and "['TEXT', 'URL']" in msg and "data.prompt_column" in msg
    with pytest.raises(PromptDataError, match="no column 'caption_en'"):
        load_prompt_records(str(tmp_path / "c.parquet"), column="caption_en")


def test_missing_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.prompts"):
        load_prompt_records(str(tmp_path / "nope.jsonl"))


def test_generator_is_deterministic_distinct_disjoint_and_balanced():
    a = make_geneval_prompts(600, seed=1)
    assert a == make_geneval_prompts(600, seed=1) and a != make_geneval_prompts(600, seed=2)
    texts = [m["prompt"] for m in a]
    assert len(set(texts)) == 600
    counts = {t: sum(m["tag"] == t for m in a) for t in {m["tag"] for m in a}}
    # equal shares of 100, but there are only 80 objects: the other tags take the 20 left
    assert counts.pop("single_object") == 80 and counts == dict.fromkeys(counts, 104)
    held_out = {m["prompt"] for m in a if m["tag"] != "single_object"}
    b = make_geneval_prompts(
        300, seed=1, exclude_prompts=held_out, tags=["counting", "colors", "position"]
    )
    assert not held_out & {m["prompt"] for m in b}
    for m in a:
        check_metadata(m, "generated")


def test_generator_templates_match_their_metadata():
    for m in make_geneval_prompts(60, seed=0):
        inc, text = m["include"], m["prompt"]
        if m["tag"] == "position":
            # "a photo of a A <relation> a B": include [B, A with position [relation, 0]]
            rel = inc[1]["position"][0]
            a, b = inc[1]["class"], inc[0]["class"]
            assert text == f"a photo of {article(a)} {a} {rel} {article(b)} {b}"
        elif m["tag"] == "counting":
            assert (
                text.endswith(plural(inc[0]["class"]))
                and m["exclude"][0]["count"] == inc[0]["count"] + 1
            )
        elif m["tag"] == "color_attr":
            assert f"{inc[0]['color']} {inc[0]['class']} and" in text
    assert len(OBJECTS) == 80
    assert plural("person") == "people" and plural("wine glass") == "wine glasses"
    assert article("orange") == "an" and article("car") == "a"


def test_generator_says_when_a_tag_runs_out():
    with pytest.raises(ValueError, match="give only 80 distinct prompts"):
        make_geneval_prompts(200, seed=0, tags=["single_object"])  # only 80 classes
    every = {m["prompt"] for m in make_geneval_prompts(80, seed=0, tags=["single_object"])}
    with pytest.raises(ValueError, match="single_object.*--n"):  # all 80 held out
        make_geneval_prompts(1, seed=0, tags=["single_object"], exclude_prompts=every)


def run_cli(argv):
    parser = argparse.ArgumentParser()
    prompts_cli.register(parser.add_subparsers(dest="command"))
    return prompts_cli.run(parser.parse_args(argv))


def test_prompts_make_and_check(tmp_path, capsys):
    evals = tmp_path / "eval.jsonl"
    assert run_cli(["prompts", "make", "--n", "30", "--seed", "3", "--out", str(evals)]) == 0
    train = tmp_path / "train.jsonl"
    argv = ["prompts", "make", "--n", "120", "--exclude", str(evals), "--out", str(train)]
    assert run_cli(argv) == 0
    held = set(load_prompt_records(str(evals)).texts)
    assert not held & set(load_prompt_records(str(train)).texts)
    assert run_cli(["prompts", "check", str(train), "--require-tag"]) == 0
    out = capsys.readouterr().out
    assert '"prompts": 120' in out and '"counting": 20' in out
    toy = tmp_path / "toy.jsonl"
    assert run_cli(["prompts", "make", "--kind", "toy", "--split", "eval", "--out", str(toy)]) == 0
    assert load_prompt_records(str(toy)).texts == load_prompts("toy", "eval")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    assert run_cli(["prompts", "check", str(tmp_path / "bad.jsonl"), "--require-tag"]) == 2
    assert "field 'tag'" in capsys.readouterr().err
