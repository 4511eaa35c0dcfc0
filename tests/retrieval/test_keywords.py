"""The local keyword strategy: the seed's tokenizer with its weaknesses fixed."""

from __future__ import annotations

import pytest

from sidecar.retrieval.keywords import keywords, stem, terms, text_terms


def test_the_seeds_basic_rules() -> None:
    # lowercase, strip punctuation, split on whitespace, drop stopwords (the seed
    # dropped short tokens too: see test_short_words_are_terms)
    assert keywords(["The DOG, a cat; and an ox!"]) == ["dog", "cat", "ox"]


@pytest.mark.parametrize(
    "text",
    ["Caroline's", "Caroline\u2019s", "Caroline\u02bcs", "CAROLINE'S", "caroline"],
)
def test_possessives_match_the_bare_word(text: str) -> None:
    assert keywords([text]) == keywords(["Caroline"])


def test_plural_possessive() -> None:
    assert keywords(["my parents' house"]) == keywords(["parent house"])


@pytest.mark.parametrize(
    ("variants"),
    [
        ["dog", "dogs"],
        ["city", "cities"],
        ["hike", "hikes", "hiked", "hiking"],
        ["run", "runs", "running"],
        ["paint", "painted", "painting", "paints"],
        ["box", "boxes"],
        ["marry", "married", "marries"],
        ["adopt", "adopted", "adopting"],
        ["class", "classes"],
        ["watch", "watches", "watched"],
        # Derivations the hand-written suffix rules missed (issue 11).
        ["use", "uses", "used", "using"],
        ["deploy", "deployment", "deployed", "deploying"],
        # Irregular verbs, which Snowball leaves as they are.
        ["buy", "bought", "buying", "buys"],
        ["eat", "ate", "eaten", "eating"],
        ["meet", "met", "meeting"],
        ["teach", "taught", "teaching"],
        ["write", "wrote", "written", "writing"],
    ],
)
def test_inflections_share_a_stem(variants: list[str]) -> None:
    assert len({stem(word) for word in variants}) == 1, {w: stem(w) for w in variants}


def test_unicode_punctuation_separates_words() -> None:
    text = "«Berlin»—Paris…Tokyo“Lima”¿Quito?¡Oslo!・Kyiv、Seoul"
    places = ["berlin", "paris", "tokyo", "lima", "quito", "oslo", "kyiv", "seoul"]
    assert keywords([text]) == [stem(place) for place in places]


def test_length_is_counted_in_characters_not_bytes() -> None:
    # Two characters (six UTF-8 bytes) are a short word, kept whole as "uv" is;
    # from three on a word is stemmed (élans -> élan).
    assert keywords(["猫犬 東京都"]) == ["猫犬", "東京都"]
    assert keywords(["ñu élans"]) == ["ñu", "élan"]


def test_question_words_are_stopwords() -> None:
    assert keywords(["What did Melanie paint when she was at the lake?"]) == [
        stem("melanie"),
        "paint",
        stem("lake"),
    ]


def test_terms_keep_repeats_for_term_frequency() -> None:
    assert terms("dogs and more dogs") == ["dog", "dog"]


def test_keywords_are_distinct_in_first_seen_order() -> None:
    assert keywords(["Berlin trip", "berlin TRIPS home"]) == ["berlin", "trip", stem("home")]


def test_stemming_from_many_threads_agrees_with_one() -> None:
    # Snowball stemmer objects keep per-call state; each thread has its own.
    from concurrent.futures import ThreadPoolExecutor

    words = [
        f"{base}{suffix}"
        for base in ("deploy", "hike", "paint", "marr")
        for suffix in ("", "s", "ed", "ing", "ment", "ies", "ingly")
    ] * 50
    uncached = stem.__wrapped__
    expected = [uncached(word) for word in words]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(4):
            assert list(pool.map(uncached, words, chunksize=7)) == expected


def test_past_forms_that_are_also_other_words_keep_their_meaning() -> None:
    # "left" is a side, "a bit" an amount, "saw" a tool as often as verbs.
    assert terms("the left knee, a bit sore; the saw and the rose") == [
        "left",
        "knee",
        "bit",
        "sore",
        "saw",
        "rose",
    ]
    # A verb whose base is a stopword is not turned into one.
    assert terms("she knew and told") == ["knew", "told"]


@pytest.mark.parametrize(
    "text",
    [
        "July 2023",
        "4 July 2023",
        "July 4, 2023",
        "July 4th 2023",
        "Jul 4, 2023",
        "2023-07-04",
        "2023/07/04",
    ],
)
def test_a_date_with_a_month_and_a_year_gives_a_month_term(text: str) -> None:
    assert "july2023" in terms(text)


@pytest.mark.parametrize(
    "text",
    [
        "may 2023 was busy",  # month before a year: a date
        "sept 5, 2021",
    ],
)
def test_lowercase_and_abbreviated_months_count_before_a_year(text: str) -> None:
    assert any(term.endswith(("2023", "2021")) and not term.isdigit() for term in terms(text))


@pytest.mark.parametrize(
    "text",
    [
        "I may go in march",  # no year: ordinary words
        "Jan 12 tickets",  # a name and a count
        "build 2023 12 345",  # numbers that are not a date
        "2023-13-01",  # no 13th month
        "July 45, 2023",  # no 45th day
    ],
)
def test_months_without_a_date_give_no_month_term(text: str) -> None:
    assert not [t for t in terms(text) if t[:1].isalpha() and t[-4:].isdigit()]


def test_short_english_words_are_terms_only_in_capitals() -> None:
    assert terms("ended up in the ER, then PT twice a week") == [
        "end", "er", "pt", "twice", "week",
    ]  # fmt: skip
    assert keywords(["When was Sam in the ER?"]) == ["sam", "er"]
    # Lowercase, er, us and go are words, not a ward, a country or a language;
    # OK, AM and PM are never terms. The number is.
    assert terms("er, ok, so we go at 10 AM, OK? with us") == ["10"]
    assert terms("Moved to the US; writes GO") == ["move", "us", "write", "go"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The repo uses uv, not pip", ["repo", "use", "uv", "pip"]),
        ("gh pr create, then jq the JSON", ["gh", "pr", "creat", "jq", "json"]),
        ("Backups go to S3 nightly", ["backup", "s3", "night"]),
        ("CI runs on every push", ["ci", "run", "everi", "push"]),
        ("20 workers, API v2", ["20", "worker", "api", "v2"]),
        ("written in C and R", ["write", "c", "r"]),
    ],
)
def test_short_words_are_terms(text: str, expected: list[str]) -> None:
    assert terms(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "I don't know, it's what we'd do",  # contractions leave t, s, d
        "u coming? oh hi, ha",  # texting and sounds
        "e.g. this, i.e. that, at 10 a.m. vs noon",  # abbreviations, vs
    ],
)
def test_letters_sounds_and_abbreviations_are_not_terms(text: str) -> None:
    assert not [t for t in terms(text) if len(t) <= 2 and not t.isdigit()]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("svc-7 is failing", ["svc-7", "svc", "7", "fail"]),
        ("pg-staging-2", ["pg-staging-2", "pg", "stage", "2"]),
        ("Ticket OPS-1142.", ["ticket", "ops-1142", "ops", "1142"]),
        ("edit pyproject.toml", ["edit", "pyproject.toml", "pyproject", "toml"]),
        ("docker build --no-cache", ["docker", "build", "no-cache", "cach"]),
        ("Python 3.11's venv", ["python", "3.11", "3", "11", "venv"]),
        ("set MAX_RETRIES", ["set", "max_retries", "max", "retri"]),
    ],
)
def test_an_identifier_is_a_term_and_so_are_its_parts(text: str, expected: list[str]) -> None:
    assert terms(text) == expected


def test_punctuation_that_joins_nothing_separates() -> None:
    # A full stop, an ellipsis, a flag's dashes: not part of an identifier.
    assert terms("Use uv. Then...wait -- run it") == ["use", "uv", "wait", "run"]
    assert terms("«svc-7»") == ["svc-7", "svc", "7"]


def test_a_texts_remembered_terms_are_its_terms() -> None:
    text = "Deployed pg-staging-2 in July 2023; the US team uses uv"
    assert text_terms(text) == tuple(terms(text))
    # Asked again (as an add's near-duplicate check and its index do), the same.
    assert text_terms(text) == tuple(terms(text))
