"""Prompt files with metadata (txt, json, jsonl, parquet), deduplication with counts, errors
that name the file, the field and the fix, the GenEval-style generator and its command."""

import argparse
import itertools
import json
import logging
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maskgrpo_ray.cli import prompts as prompts_cli
from maskgrpo_ray.prompts.generate import (
    COLORS,
    COLOURABLE,
    ENUMERATE_LIMIT,
    OBJECTS,
    POOL_SIZES,
    TEMPLATES,
    _pair,
    article,
    make_geneval_prompts,
    metadata_key,
    plural,
    prompt_set_metadata,
)
from maskgrpo_ray.prompts.geneval_schema import TAGS as GENEVAL_TAGS
from maskgrpo_ray.prompts.geneval_schema import check_metadata
from maskgrpo_ray.prompts.loading import (
    PromptDataError,
    PromptRecord,
    load_prompt_records,
    load_prompts,
)
from maskgrpo_ray.worlds.toy.world import Caption

META = [
    {"tag": "counting", "include": [{"class": "cup", "count": 2}], "prompt": "a photo of two cups"},
    {
        "tag": "colors",
        "include": [{"class": "car", "count": 1, "color": "pink"}],
        "prompt": "a photo of a pink car",
    },
]


def without_prompt(meta):
    return {k: v for k, v in meta.items() if k != "prompt"}


# ---- formats -------------------------------------------------------------------------------


def test_jsonl_keeps_geneval_metadata_and_line_numbers(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(META[0]) + "\n" + '"  a   dog "\n' + json.dumps(META[1]) + "\n")
    loaded = load_prompt_records(str(path))
    assert loaded.records == [
        PromptRecord(META[0]["prompt"], without_prompt(META[0]), f"{path}:1"),
        PromptRecord("a dog", None, f"{path}:2"),  # a bare string: whitespace normalised
        PromptRecord(META[1]["prompt"], without_prompt(META[1]), f"{path}:3"),
    ]
    assert loaded.dropped == {} and loaded.source == str(path)


def test_json_list_of_captions_and_strings(tmp_path):
    path = tmp_path / "train.json"  # the official release's [{"caption": ...}]
    path.write_text(json.dumps([{"caption": "a cat", "id": 7}, "a dog", {"prompt": "a cow"}]))
    loaded = load_prompt_records(str(path))
    assert [(r.text, r.meta) for r in loaded.records] == [
        ("a cat", {"id": 7}),
        ("a dog", None),
        ("a cow", None),
    ]
    assert loaded.records[1].source == f"{path}[1]"


def test_txt_is_one_prompt_a_line(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n  a \t dog \n")
    loaded = load_prompt_records(str(tmp_path / "p.txt"))
    assert [(r.text, r.meta) for r in loaded.records] == [("a cat", None), ("a dog", None)]
    assert loaded.records[1].source.endswith("p.txt:2")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog"]


def test_parquet_column_and_the_other_columns_as_metadata(tmp_path):
    table = pa.table(
        {
            "TEXT": ["a cat", None, "a dog"],
            "AESTHETIC_SCORE": [6.5, 1.0, 5.0],
            "prompt": list("xyz"),
        }
    )
    pq.write_table(table, tmp_path / "laion.parquet")
    loaded = load_prompt_records(str(tmp_path / "laion.parquet"), column="TEXT")
    assert [(r.text, r.meta) for r in loaded.records] == [
        ("a cat", {"AESTHETIC_SCORE": 6.5, "prompt": "x"}),
        ("a dog", {"AESTHETIC_SCORE": 5.0, "prompt": "z"}),
    ]
    assert loaded.dropped == {"blank": 1}  # the null caption
    # without a column the "prompt" column is the text
    assert load_prompts(str(tmp_path / "laion.parquet")) == ["x", "y", "z"]
    assert load_prompts(str(tmp_path / "laion.parquet"), column="TEXT") == ["a cat", "a dog"]


def test_toy_prompt_set_carries_geneval_metadata():
    for split in ("train", "eval"):
        loaded = load_prompt_records("toy", split)
        assert loaded.texts == load_prompts("toy", split) and loaded.dropped == {}
        for r in loaded.records:
            assert r.meta == without_prompt(Caption.parse(r.text).geneval_metadata())
            check_metadata({**r.meta, "prompt": r.text}, r.source)
    train, held = set(load_prompts("toy", "train")), set(load_prompts("toy", "eval"))
    assert len(train) + len(held) == 96 and not train & held


# ---- deduplication -------------------------------------------------------------------------


def test_blanks_and_duplicates_are_dropped_counted_and_logged(tmp_path, caplog):
    # lines: 1 "a cat", 2 blank, 3 repeat of 1, 4 repeat of 1 after normalising, 5 "a dog",
    # 6 blank (spaces only) -> kept [cat, dog], 2 blank, 2 duplicate
    (tmp_path / "p.txt").write_text("a cat\n\na cat\na  cat\na dog\n   \n")
    with caplog.at_level(logging.INFO, logger="maskgrpo_ray.prompts.loading"):
        loaded = load_prompt_records(str(tmp_path / "p.txt"))
    assert loaded.texts == ["a cat", "a dog"]
    assert loaded.dropped == {"blank": 2, "duplicate": 2}
    [line] = [r for r in caplog.records if r.name == "maskgrpo_ray.prompts.loading"]
    msg = line.getMessage()
    assert line.levelno == logging.WARNING
    assert "dropped 2 blank" in msg and "2 repeated" in msg and "p.txt:3 repeats" in msg


def test_a_repeat_with_other_metadata_is_still_a_repeat(tmp_path, caplog):
    other = {**META[0], "tag": "colors"}
    (tmp_path / "p.jsonl").write_text(f"{json.dumps(META[0])}\n\n{json.dumps(other)}\n")
    with caplog.at_level(logging.INFO, logger="maskgrpo_ray.prompts.loading"):
        loaded = load_prompt_records(str(tmp_path / "p.jsonl"), "eval")
    assert [r.meta for r in loaded.records] == [without_prompt(META[0])]  # the first is kept
    assert loaded.dropped == {"blank": 1, "duplicate": 1}
    assert "1 of the repeats had other metadata" in caplog.text


def test_a_clean_file_logs_one_info_line(tmp_path, caplog):
    (tmp_path / "p.txt").write_text("a cat\n")
    with caplog.at_level(logging.INFO, logger="maskgrpo_ray.prompts.loading"):
        load_prompt_records(str(tmp_path / "p.txt"))
    [line] = [r for r in caplog.records if r.name == "maskgrpo_ray.prompts.loading"]
    assert line.levelno == logging.INFO and "1 prompts" in line.getMessage()


# ---- errors: file, field, fix --------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, kwargs, needles",
    [
        ("empty.jsonl", "", {}, ["empty.jsonl", "holds no prompts", "nothing in it", "--prompts"]),
        ("allblank.txt", "\n \n", {}, ["allblank.txt", "2 blank", "data.prompts"]),
        (
            "bad.jsonl",
            '{"prompt": "a"}\n{oops\n',
            {},
            ["bad.jsonl:2", "not valid JSON", "one JSON object"],
        ),
        ("bad.json", "[{", {}, ["bad.json", "not valid JSON", "'caption'"]),
        ("dict.json", '{"prompts": []}', {}, ["dict.json", "JSON list", ".jsonl"]),
        (
            "keys.jsonl",
            '{"prompt": "a"}\n{"text": "a cat", "id": 1}\n',
            {},
            ["keys.jsonl:2", "['id', 'text']", "'prompt'", "data.prompt_column"],
        ),
        (
            "col.jsonl",
            '{"prompt": "a"}\n',
            {"column": "TEXT"},
            ["col.jsonl:1", "['prompt']", "['TEXT']", "--prompt-column"],
        ),
        ("num.jsonl", '{"prompt": 3}\n', {}, ["num.jsonl:1", "field 'prompt'", "int", "string"]),
        ("list.json", "[[1]]", {}, ["list.json[0]", "list", "fix that entry"]),
        ("p.xml", "<a/>", {}, ["p.xml", "'.xml'", ".jsonl", ".parquet"]),
        (
            "untagged.jsonl",
            json.dumps(META[0]) + "\n" + json.dumps({"prompt": "a cat"}) + "\n",
            {"require_tag": True},
            ["untagged.jsonl:2", "no field 'tag'", "needs a tag", *GENEVAL_TAGS, "add it"],
        ),
        (
            "badtag.jsonl",
            json.dumps({"prompt": "a cat", "tag": "colour"}) + "\n",
            {"require_tag": True},
            ["badtag.jsonl:1", "'colour'", "color_attr", "maskgrpo prompts make"],
        ),
    ],
)
def test_bad_files_name_file_field_and_fix(tmp_path, name, content, kwargs, needles):
    (tmp_path / name).write_text(content)
    with pytest.raises(PromptDataError) as err:
        load_prompt_records(str(tmp_path / name), **kwargs)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_no_prompt_left_after_dropping_says_how_many_and_why(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": " "}\n\n{"prompt": null}\n')
    with pytest.raises(
        PromptDataError, match=r"p.jsonl: holds no prompts \(3 entries, dropped: 3 blank\)"
    ):
        load_prompt_records(str(tmp_path / "p.jsonl"))


def test_parquet_without_the_column_lists_its_columns(tmp_path):
    pq.write_table(pa.table({"TEXT": ["a"], "URL": ["u"], "WIDTH": [3]}), tmp_path / "c.parquet")
    with pytest.raises(PromptDataError) as err:
        load_prompt_records(str(tmp_path / "c.parquet"))
    msg = str(err.value)
    assert "c.parquet" in msg and "['TEXT', 'URL', 'WIDTH']" in msg
    assert (
        "'prompt' or 'caption'" in msg and "data.prompt_column" in msg and "--prompt-column" in msg
    )
    with pytest.raises(PromptDataError, match="no column 'caption_en'"):
        load_prompt_records(str(tmp_path / "c.parquet"), column="caption_en")
    with pytest.raises(PromptDataError, match="column 'WIDTH' holds int64, not text"):
        load_prompt_records(str(tmp_path / "c.parquet"), column="WIDTH")


def test_unreadable_files(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(PromptDataError, match="x.parquet: not a readable Parquet file"):
        load_prompt_records(str(tmp_path / "x.parquet"))
    (tmp_path / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(PromptDataError, match="latin.txt: not UTF-8 text .* re-encode"):
        load_prompt_records(str(tmp_path / "latin.txt"))


def test_missing_file_names_it_and_the_setting(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(PromptDataError) as err:
        load_prompt_records(missing)
    assert isinstance(err.value, FileNotFoundError)  # callers that catch that still do
    assert missing in str(err.value) and "data.prompts" in str(err.value)
    with pytest.raises(PromptDataError, match="a folder, not a prompts file"):
        load_prompt_records(str(tmp_path))  # a folder is not a prompts file


# ---- the generator -------------------------------------------------------------------------


def test_pair_indexing_is_a_bijection_onto_ordered_distinct_pairs():
    items = "abcde"
    pairs = [_pair(i, items) for i in range(len(items) * (len(items) - 1))]
    assert sorted(pairs) == sorted(itertools.permutations(items, 2))


def test_every_template_index_gives_a_distinct_prompt_across_all_tags():
    seen: dict[str, str] = {}
    for tag, (size, make) in TEMPLATES.items():
        if size > ENUMERATE_LIMIT:  # color_attr: a sample of 20,000 indices
            idx = random.Random(0).sample(range(size), 20_000)
        else:
            idx = range(size)
        for i in idx:
            text = make(i)["prompt"]
            assert text not in seen, (tag, text, seen.get(text))
            seen[text] = tag
    # 80 classes, 79 colourable (no "<colour> person", as GenEval), 10 colours, 3 counts, 4 relations
    assert POOL_SIZES == {
        "single_object": 80,
        "two_object": 80 * 79,
        "counting": 80 * 3,
        "colors": 79 * 10,
        "position": 80 * 79 * 4,
        "color_attr": 79 * 78 * 10 * 9,
    }
    assert len(set(OBJECTS)) == 80 and "person" not in COLOURABLE and len(COLORS) == 10


def test_generator_is_deterministic_distinct_and_balanced():
    a = make_geneval_prompts(600, seed=1)
    assert a == make_geneval_prompts(600, seed=1) and a != make_geneval_prompts(600, seed=2)
    assert len({m["prompt"] for m in a}) == 600
    counts = {t: sum(m["tag"] == t for m in a) for t in GENEVAL_TAGS}
    # equal shares of 100, but single_object has 80 prompts: the other 5 tags share 520
    assert counts == {"single_object": 80, **dict.fromkeys(GENEVAL_TAGS[1:], 104)}
    for m in a:
        check_metadata(m, "generated")


def test_generator_excludes_texts_and_metadata_of_the_evaluation_set():
    held = make_geneval_prompts(300, seed=1, tags=["counting", "colors", "position"])
    texts = {m["prompt"] for m in held}
    out = make_geneval_prompts(3000, seed=1, exclude_prompts=texts)
    assert not texts & {m["prompt"] for m in out}
    # GenEval's own wording differs ("a photo of two persons"): its metadata still excludes it
    geneval_line = {
        "tag": "counting",
        "include": [{"class": "person", "count": 2}],
        "exclude": [{"class": "person", "count": 3}],
        "prompt": "a photo of two persons",
    }
    every = make_geneval_prompts(240, seed=0, tags=["counting"])
    assert "a photo of two people" in {m["prompt"] for m in every}
    with pytest.raises(ValueError, match="only 239 distinct prompts"):
        make_geneval_prompts(240, seed=0, tags=["counting"], exclude_metadata=[geneval_line])
    rest = make_geneval_prompts(239, seed=0, tags=["counting"], exclude_metadata=[geneval_line])
    assert "a photo of two people" not in {m["prompt"] for m in rest}


def test_an_exhausted_tag_gives_its_share_to_the_others():
    singles = make_geneval_prompts(80, seed=0, tags=["single_object"])
    out = make_geneval_prompts(12, seed=0, exclude_prompts=[m["prompt"] for m in singles])
    counts = {t: sum(m["tag"] == t for m in out) for t in GENEVAL_TAGS}
    # single_object has 0 left; 12 over the other 5: 2 each, the first 2 tags take 1 more
    assert counts == {
        "single_object": 0,
        "two_object": 3,
        "counting": 3,
        "colors": 2,
        "position": 2,
        "color_attr": 2,
    }


def test_metadata_key_ignores_wording_and_order_unless_a_position_refers_to_it():
    two = make_geneval_prompts(1, seed=0, tags=["two_object"])[0]
    swapped = {**two, "include": two["include"][::-1], "prompt": "other words"}
    assert metadata_key(two) == metadata_key(swapped)
    pos = make_geneval_prompts(1, seed=0, tags=["position"])[0]
    assert metadata_key(pos) != metadata_key({**pos, "include": pos["include"][::-1]})


def test_each_tag_writes_geneval_schema_and_wording():
    for m in make_geneval_prompts(600, seed=3):
        inc, text, tag = m["include"], m["prompt"], m["tag"]
        assert list(m) == ["tag", "include", *(["exclude"] if tag == "counting" else []), "prompt"]
        if tag == "single_object":
            (o,) = inc
            assert o == {"class": o["class"], "count": 1}
            assert text == f"a photo of {article(o['class'])} {o['class']}"
        elif tag == "two_object":
            a, b = inc
            assert a["class"] != b["class"] and a["count"] == b["count"] == 1
            assert (
                text
                == f"a photo of {article(a['class'])} {a['class']} and {article(b['class'])} {b['class']}"
            )
        elif tag == "counting":
            (o,) = inc
            words = {2: "two", 3: "three", 4: "four"}
            assert m["exclude"] == [{"class": o["class"], "count": o["count"] + 1}]
            assert text == f"a photo of {words[o['count']]} {plural(o['class'])}"
        elif tag == "colors":
            (o,) = inc
            assert set(o) == {"class", "count", "color"} and o["class"] != "person"
            assert text == f"a photo of {article(o['color'])} {o['color']} {o['class']}"
        elif tag == "position":
            # GenEval: "a photo of a A <relation> a B" has include [B, A at [relation, 0]]
            b, a = inc
            rel, target = a["position"]
            assert target == 0 and "position" not in b
            assert (
                text
                == f"a photo of {article(a['class'])} {a['class']} {rel} {article(b['class'])} {b['class']}"
            )
        else:
            a, b = inc
            assert a["color"] != b["color"]
            assert text == (
                f"a photo of {article(a['color'])} {a['color']} {a['class']} and "
                f"{article(b['color'])} {b['color']} {b['class']}"
            )


def test_english_plurals_and_articles():
    assert [
        plural(o) for o in ("person", "sheep", "skis", "scissors", "knife", "computer mouse")
    ] == [
        "people",
        "sheep",
        "skis",
        "scissors",
        "knives",
        "computer mice",
    ]
    assert [plural(o) for o in ("wine glass", "bus", "bench", "toothbrush", "tv", "bear")] == [
        "wine glasses",
        "buses",
        "benches",
        "toothbrushes",
        "tvs",
        "bears",
    ]
    assert [article(w) for w in ("orange", "apple", "umbrella", "elephant", "car", "red")] == [
        "an",
        "an",
        "an",
        "an",
        "a",
        "a",
    ]


def test_generator_says_when_it_runs_out():
    with pytest.raises(ValueError, match="give only 80 distinct prompts.*'single_object': 80"):
        make_geneval_prompts(200, seed=0, tags=["single_object"])  # only 80 classes
    every = {m["prompt"] for m in make_geneval_prompts(80, seed=0, tags=["single_object"])}
    with pytest.raises(ValueError, match=r"--n.*only 0 distinct .*--tags"):  # all 80 held out
        make_geneval_prompts(1, seed=0, tags=["single_object"], exclude_prompts=every)
    with pytest.raises(ValueError, match=r"unknown tags \['colour'\]"):
        make_geneval_prompts(1, seed=0, tags=["colour"])


def test_toy_prompt_metadata_is_the_toy_split():
    metas = prompt_set_metadata("toy", "eval")
    assert [m["prompt"] for m in metas] == load_prompts("toy", "eval")
    assert metas[0] == Caption.parse(metas[0]["prompt"]).geneval_metadata()


# ---- maskgrpo prompts make / check ---------------------------------------------------------


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
    capsys.readouterr()
    assert run_cli(["prompts", "check", str(train), "--require-tag"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 120 and report["dropped"] == {}
    assert report["tags"] == dict.fromkeys(sorted(GENEVAL_TAGS), 20)
    for suffix in (".json", ".txt"):
        out = tmp_path / f"train{suffix}"
        assert run_cli([*argv[:-1], str(out)]) == 0
        assert load_prompts(str(out)) == load_prompts(str(train))
    toy = tmp_path / "toy.jsonl"
    assert run_cli(["prompts", "make", "--kind", "toy", "--split", "eval", "--out", str(toy)]) == 0
    assert load_prompt_records(str(toy)).records == [
        PromptRecord(r.text, r.meta, f"{toy}:{i + 1}")
        for i, r in enumerate(load_prompt_records("toy", "eval").records)
    ]


def test_prompts_make_of_the_toy_set_honours_n_and_seed(tmp_path, capsys):
    full = load_prompt_records("toy", "train").records
    out = tmp_path / "five.jsonl"
    argv = ["prompts", "make", "--kind", "toy", "--n", "5", "--seed", "7", "--out", str(out)]
    assert run_cli(argv) == 0
    got = [(r.text, r.meta) for r in load_prompt_records(str(out)).records]
    keep = sorted(random.Random(7).sample(range(len(full)), 5))  # --seed's draw, split order
    assert got == [(full[i].text, full[i].meta) for i in keep]
    assert capsys.readouterr().out.startswith(f"wrote 5 prompts to {out}")
    again = tmp_path / "again.jsonl"
    assert run_cli([*argv[:-1], str(again)]) == 0 and again.read_text() == out.read_text()
    assert run_cli(["prompts", "make", "--kind", "toy", "--out", str(out)]) == 0  # no --n: all
    assert len(load_prompt_records(str(out)).records) == len(full) > 5


def test_prompts_check_counts_drops(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text(f'{json.dumps(META[0])}\n{json.dumps(META[0])}\n"a cat"\n')
    assert run_cli(["prompts", "check", str(tmp_path / "p.jsonl")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 2 and report["dropped"] == {"duplicate": 1}
    assert report["tags"] == {"None": 1, "counting": 1}


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["check", "{d}/bad.jsonl", "--require-tag"], ["bad.jsonl:1", "field 'tag'"]),
        (["check", "{d}/nope.txt"], ["nope.txt", "no such prompts file"]),
        (["make", "--n", "3", "--out", "{d}/p.csv"], ["p.csv", ".jsonl"]),
        (["make", "--n", "3", "--tags", "colour", "--out", "{d}/p.txt"], ["unknown tags"]),
        (["make", "--kind", "toy", "--tags", "colors", "--out", "{d}/p.txt"], ["--kind geneval"]),
        (["make", "--kind", "toy", "--n", "500", "--out", "{d}/p.txt"], ["--n 500", "has 72"]),
        (["make", "--kind", "toy", "--n", "0", "--out", "{d}/p.txt"], ["--n 0", "from 1 to 72"]),
        (["make", "--n", "3", "--exclude", "{d}/nope.jsonl", "--out", "{d}/p.txt"], ["nope.jsonl"]),
    ],
)
def test_prompts_command_errors_exit_2_with_the_message(tmp_path, capsys, argv, needles):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    code = run_cli(["prompts", *(a.format(d=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("maskgrpo: ")
    for needle in needles:
        assert needle in err, (needle, err)
