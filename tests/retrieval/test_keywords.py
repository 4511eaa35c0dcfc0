"""The local keyword strategy: the seed's tokenizer with its weaknesses fixed."""

from __future__ import annotations

import pytest

from sidecar.retrieval.keywords import keywords, stem, terms


def test_the_seeds_basic_rules() -> None:
    # lowercase, strip punctuation, split on whitespace, drop short tokens and stopwords
    # (two capitals alone are kept: see test_two_capitals_are_a_term...)
    assert keywords(["The DOG, a cat; and an ox!"]) == ["dog", "cat"]


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
    # Two characters (six UTF-8 bytes) are too short; three are kept.
    assert keywords(["猫犬 東京都"]) == ["東京都"]
    assert keywords(["ñu élan"]) == ["élan"]


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


def test_two_capitals_are_a_term_other_two_letter_words_are_not() -> None:
    assert terms("ended up in the ER, then PT twice a week") == [
        "end", "er", "pt", "twice", "week",
    ]  # fmt: skip
    assert keywords(["When was Sam in the ER?"]) == ["sam", "er"]
    # Lowercase short words stay dropped; so do OK, AM and PM in capitals.
    assert terms("er, ok, so we go at 10 AM, OK?") == []
