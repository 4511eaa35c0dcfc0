"""Keywords from text: the `local` strategy's tokenizer and stemmer.

It starts from the seed's BM25 tokenizer (lowercase, strip punctuation, split
on whitespace, drop stopwords) and fixes what that misses on conversational
text and on an agent's notes:

- a possessive ("Caroline's", with a straight or a typographic apostrophe,
  or "parents'") matches the bare word;
- plurals and simple inflections ("dogs", "hiking", "moved", "cities") match
  their stem, because memories and queries go through the same stemmer;
- any Unicode punctuation or symbol separates words, not just ASCII, except
  a dot, dash or underscore between letters or digits: an identifier
  ("pg-staging-2", "pyproject.toml", "OPS-1142", "--no-cache", "3.11") is a
  term whole, and each of its parts is a term too;
- short words are terms: tools and names of 1-2 characters (uv, gh, jq, S3,
  CI), numbers and versions (20, v2, 5433); the seed dropped every token of
  2 characters or fewer. Left out: stopwords, a lowercase letter alone (the
  "t" of "don't", the "u" of texting), and short English words and sounds
  (us, go, oh, ok) unless the text writes them in capitals standing alone
  (US, GO);
- lengths are counted in characters, not bytes.

Stems are Snowball's English (Porter 2) through PyStemmer, which also joins
derivations the earlier hand-written suffix rules missed (use/uses/used,
deploy/deployment). Both sides of a match are stemmed the same way.

Owns: the tokenizer, STOPWORDS, which short words and identifiers are terms,
the irregular verbs, stemming and month terms.
Must not touch: other sidecar modules, the store, configuration, the network:
pure functions over text, whose only state is per-thread stemmers, a memo of
stems and one of the latest texts' terms.
"""

from __future__ import annotations

import functools
import re
import threading
import unicodedata
from collections.abc import Iterable

import Stemmer

MIN_CHARS = 3

# The seed's list is 20 words; conversational questions need the common
# question words and auxiliaries too, or "what did she ..." matches everything.
_STOPWORD_TEXT = """
a about above after again against all also am an and any are as at be because
been before being below between both but by can cannot could did do does doing
done down during each ever few for from further get got had has have having he
her here hers herself him himself his how i if in into is it its itself just
know let like me more most much my myself no nor not now of off on once one
ones only or other our ours ourselves out over own really same she should so
some still such tell than that the their theirs them themselves then there these
they think this those through to too under until up very want wants was we were
what when where which while who whom why will with would yes you your yours
yourself yourselves
"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())

# Apostrophe look-alikes, folded to ' before possessives are removed.
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u02bc": "'", "\uff07": "'", "`": "'"})
_POSSESSIVE = re.compile(r"(?<=\w)'s\b|(?<=s)'(?=\s|$)")


def _is_separator(ch: str) -> bool:
    category = unicodedata.category(ch)
    return category[0] in "PSZC"


# A dot, dash or underscore between letters or digits joins them into an
# identifier ("svc-7", "pyproject.toml", "3.11"); anywhere else (a full stop,
# "--" before a flag, "..."), it separates words as other punctuation does.
_JOINERS = "-._"
_JOINER = re.compile(r"[-._]")
# For ASCII text (most of it) one regex does what the per-character category
# test does: anything but a letter, a digit or a joiner separates words.
_ASCII_WORD = re.compile(r"[a-z0-9]+(?:[-._][a-z0-9]+)*")
_WORD = re.compile(r"[^\s._-]+(?:[-._][^\s._-]+)*")


def words(text: str) -> list[str]:
    """Lowercased words and identifiers, with possessives and other
    punctuation removed: "svc-7's pyproject.toml, --no-cache!" gives
    svc-7, pyproject.toml and no-cache."""
    if text.isascii():
        text = _POSSESSIVE.sub("", text.lower().replace("`", "'"))
        return _ASCII_WORD.findall(text)
    text = unicodedata.normalize("NFKC", text).casefold().translate(_APOSTROPHES)
    text = _POSSESSIVE.sub("", text)
    cleaned = "".join(" " if ch not in _JOINERS and _is_separator(ch) else ch for ch in text)
    return _WORD.findall(cleaned)


# Snowball's English stemmer (PyStemmer, C). Its stemmer objects keep
# per-call state, so each thread has its own.
_STEMMERS = threading.local()

# Irregular verbs, which Snowball leaves alone (bought stays bought): base,
# past, past participle. "When did she buy it" meets "I bought it" once the
# forms are read as their base. Forms that are also common other words are
# left out below, and so are verbs whose base is a stopword or too short to
# be a term (know, tell, think, go).
_IRREGULAR_VERBS = """
arise arose arisen awake awoke awoken become became become begin began begun
bend bent bent bite bit bitten bleed bled bled blow blew blown break broke
broken breed bred bred bring brought brought build built built burn burnt burnt
buy bought bought catch caught caught choose chose chosen cling clung clung
creep crept crept deal dealt dealt dig dug dug draw drew drawn dream dreamt
dreamt drink drank drunk drive drove driven eat ate eaten fall fell fallen feed
fed fed feel felt felt fight fought fought find found found flee fled fled fly
flew flown forbid forbade forbidden forget forgot forgotten forgive forgave
forgiven freeze froze frozen give gave given grow grew grown hang hung hung
hear heard heard hide hid hidden hold held held keep kept kept kneel knelt
knelt lead led led lean leant leant leap leapt leapt learn learnt learnt lend
lent lent lose lost lost make made made mean meant meant meet met met overcome
overcame overcome pay paid paid ride rode ridden ring rang rung rise rose risen
run ran run seek sought sought sell sold sold send sent sent sew sewed sewn
shake shook shaken shine shone shone shoot shot shot show showed shown shrink
shrank shrunk sing sang sung sink sank sunk sit sat sat sleep slept slept slide
slid slid speak spoke spoken speed sped sped spend spent spent spill spilt
spilt spin spun spun spit spat spat spring sprang sprung stand stood stood
steal stole stolen stick stuck stuck sting stung stung stink stank stunk
strike struck struck swear swore sworn sweep swept swept swim swam swum swing
swung swung take took taken teach taught taught tear tore torn throw threw
thrown understand understood understood undergo underwent undergone wake woke
woken wear wore worn weep wept wept win won won withdraw withdrew withdrawn
write wrote written
"""
# Also a noun, an adjective or a name often enough to be read as one.
_NOT_VERBS = frozenset(
    "bit bound drew fell felt found ground lead left lit rose saw spoke".split()  # noqa: SIM905
)


def _irregular() -> dict[str, str]:
    forms: dict[str, str] = {}
    listed = _IRREGULAR_VERBS.split()
    for at in range(0, len(listed), 3):
        base, *inflected = listed[at : at + 3]
        for form in inflected:
            if form != base and form not in _NOT_VERBS:
                forms.setdefault(form, base)
    return forms


IRREGULAR = _irregular()


# Indexing a tier stems every word of every entry, and a vocabulary is far
# smaller than a tier: cached, a stem is a dictionary hit. Bounded, since
# words come from clients.
@functools.lru_cache(maxsize=32_768)
def stem(word: str) -> str:
    """Snowball English: use, uses, used -> use; deploy, deployment ->
    deploy; cities, city -> citi; an irregular verb's forms as its base
    (bought -> buy, ate -> eat). Words with digits or other non-letters
    are kept whole, and so is a word whose stem would be shorter than a
    term may be."""
    word = IRREGULAR.get(word, word)
    if len(word) <= 3 or not word.isalpha():
        return word
    stemmer = getattr(_STEMMERS, "english", None)
    if stemmer is None:
        # No cache of its own: stem() has one for all threads.
        stemmer = _STEMMERS.english = Stemmer.Stemmer("english", 0)
    base: str = stemmer.stemWord(word)
    return base if len(base) >= MIN_CHARS else word


MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
# Month names and their usual abbreviations ("sept" too), read as a month
# only before a year (or a day and a year): alone, "may", "march" and "jan"
# are as often other words.
_MONTH_OF = (
    {name: name for name in MONTHS}
    | {name[:3]: name for name in MONTHS if name != "may"}
    | {"sept": "september"}
)
_YEAR = re.compile(r"(1[89]|2[0-9])[0-9][0-9]")
_DAY = re.compile(r"(0?[1-9]|[12][0-9]|3[01])(st|nd|rd|th)?")
_MONTH_NUMBER = re.compile(r"0[1-9]|1[0-2]")
# Short English words and sounds, which are terms only where a text writes
# them in capitals standing alone (US, GO, ER): lowercase, they are "us",
# "go", "er", not a country, a language or a ward. A letter alone is read
# the same way (C, R and plan B are terms; the "t" of "don't" is not).
_SHORT_ENGLISH_TEXT = "ah aw eh er ex go ha hm hi ho ll mm oh oi ow re uh um us ve vs ya ye yo"
_SHORT_ENGLISH = frozenset(_SHORT_ENGLISH_TEXT.split())
_CAPITALS = re.compile(r"\b[A-Z]{1,2}\b")
# Never terms, even in capitals: OK, AM, PM, and the letters contractions
# leave ("don't", "I'm", "she'd"), which then need no look at the capitals.
_NOT_ACRONYMS = frozenset({"ok", "am", "pm", "s", "t", "m", "d"})
# Abbreviations read as punctuation: neither they nor their letters are terms.
_NOT_IDENTIFIERS = frozenset({"e.g", "i.e", "a.m", "p.m"})


def month_term(month: str, year: str) -> str:
    """One term for a month of a year ("july2023"): a month name alone is
    too often an ordinary word ("may", "march") to index dates by."""
    return f"{month}{year}"


def _month_at(split: list[str], i: int) -> str | None:
    """The month-of-year term of a date starting at split[i], if one does:
    "July 2023", "Dec 4, 2023", "December 4th 2023" ("4 December 2023" is
    found at its month), or ISO "2023-12-04"."""
    word = split[i]
    month = _MONTH_OF.get(word)
    if month is not None:
        after = split[i + 1 : i + 3]
        if after and _YEAR.fullmatch(after[0]):
            return month_term(month, after[0])
        if len(after) == 2 and _DAY.fullmatch(after[0]) and _YEAR.fullmatch(after[1]):
            return month_term(month, after[1])
        return None
    if (
        _YEAR.fullmatch(word)
        and i + 2 < len(split)
        and _MONTH_NUMBER.fullmatch(split[i + 1])
        and len(split[i + 2]) == 2
        and _DAY.fullmatch(split[i + 2])
    ):
        return month_term(MONTHS[int(split[i + 1]) - 1], word)
    return None


def terms(text: str) -> list[str]:
    """Every stemmed, non-stopword term of the text, in order, repeats kept,
    and a month-of-year term wherever a date names a month and a year. An
    identifier is a term, followed by its parts ("pg-staging-2": pg-staging-2,
    pg, stage, 2), so a search for it ranks the entry holding it exactly
    above those sharing its parts.

    Used to index a memory: term frequency matters to BM25.
    """
    found: list[str] = []
    split: list[str] = []
    # Where an identifier starts in `split` (its first part), and it.
    joined: dict[int, str] = {}
    for word in words(text):
        if "-" in word or "." in word or "_" in word:
            if word in _NOT_IDENTIFIERS:
                continue
            joined[len(split)] = word
            split.extend(_JOINER.split(word))
        else:
            split.append(word)
    capitals: set[str] | None = None  # looked for only if a text has a short word
    for i, word in enumerate(split):
        if joined and (identifier := joined.get(i)) is not None:
            found.append(identifier)
        size = len(word)
        if size >= MIN_CHARS:
            if word in STOPWORDS:
                continue
            found.append(stem(word))
            # Every date's month or year is a word of 3 or more characters.
            if (word in _MONTH_OF or (size == 4 and word.isdigit())) and (
                month := _month_at(split, i)
            ):
                found.append(month)
        elif word not in STOPWORDS and word not in _NOT_ACRONYMS:
            if (size == 2 and word not in _SHORT_ENGLISH) or not word.isalpha():
                found.append(word)  # uv, jq, s3, v2, 20, 7
                continue
            if capitals is None:
                capitals = {a.lower() for a in _CAPITALS.findall(text)}
            if word in capitals:
                found.append(word)  # US, GO, C
    return found


# An add reads its content's terms up to three times (its near-duplicates,
# then the index terms its partition appends), and a tier's candidates come
# back write after write: the latest texts' terms are kept, not found again
# (a few hundred: enough for the adds in flight, and contents are large).
@functools.lru_cache(maxsize=256)
def text_terms(text: str) -> tuple[str, ...]:
    """`terms(text)`, remembered for the latest texts."""
    return tuple(terms(text))


def keywords(texts: Iterable[str]) -> list[str]:
    """The distinct terms of some texts, in first-seen order."""
    seen: dict[str, None] = {}
    for text in texts:
        for term in terms(text):
            seen.setdefault(term, None)
    return list(seen)
