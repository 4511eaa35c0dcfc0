"""The frozen block's layout, as an entry could imitate it: a rule, a lone
entry separator, a tier header. Found on a normalised form of each line, so
no spelling of one gets through (issue 25: a no-break space between USER and
PROFILE was enough).

The normalised form of a line, used for this check only (the entry is stored
and shown as written):

- line breaks: CR, CRLF, U+2028 and U+2029 end a line, as a renderer shows;
- removed: format characters (Unicode category Cf: zero-width space, ZWNJ,
  ZWJ, word joiner, BOM, bidi controls, tags ...), the other
  default-ignorable code points, variation selectors, and after NFKD every
  combining mark (category Mn or Me: "ÚSER", "U\u0483SER");
- lines NFKD would make a space and a mark ("‗", "‾", "¯") folded first;
- NFKC: full-width, mathematical and other compatibility letters and
  brackets become ASCII;
- every Unicode space (category Zs: U+00A0, U+2000-U+200A, U+202F, U+205F,
  U+3000 ...), the tab and the braille blank (U+2800) become a plain space;
- every dash (category Pd, U+2212 minus, heavy minus, hyphen bullet) and the
  box-drawing horizontals the block's rule is made of become "-";
- Cyrillic, Greek, Armenian, Cherokee and small-capital letters that look
  like Latin ones, and ornamental brackets, become the Latin letter or the
  ASCII bracket.

Owns: that normalisation, what counts as a rule, separator or header line,
and bracketing such lines (`neutralise`). Must not touch: the other scanner
patterns, the store, configuration: pure functions.
"""

from __future__ import annotations

import re
import unicodedata

# Every Cf character of Unicode 15 (tests/retrieval/test_scanner.py checks this
# against the running Python's unicodedata) and the Hangul fillers, plus the
# other default-ignorable code points: the combining grapheme joiner, Khmer
# inherent vowels, Mongolian variation selectors, unassigned specials and tags.
IGNORABLE = re.compile(
    "[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f"
    "\u202a-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
    "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0000-\U000e007f\u115f\u1160\u3164\uffa0"
    "\u034f\u17b4\u17b5\u180b-\u180d\u180f\ufff0-\ufff8\U000e0080-\U000e00ff"
    "\U000e01f0-\U000e0fff]"
)
SELECTORS = re.compile("[\ufe00-\ufe0f\U000e0100-\U000e01ef]")

_LINE_BREAKS = str.maketrans({"\r": "\n", "\u2028": "\n", "\u2029": "\n", "\x85": "\n"})


def lines(text: str) -> str:
    """The text with every line break a renderer honours made a newline."""
    return text.replace("\r\n", "\n").translate(_LINE_BREAKS)


_MARK_CATEGORIES = ("Mn", "Me")


def _bmp_marks() -> re.Pattern[str]:
    """Every combining mark (category Mn or Me) below U+10000 of this
    Python's Unicode: a forger can put any of them on a Latin letter and
    have it still read as one ("U\u0483SER"). One class of the basic plane
    is a bitmap, as fast as a short one; beyond it a class is searched range
    by range (several times slower), so those are looked up one by one."""
    basic = map(chr, range(0x10000))
    marks = "".join(ch for ch in basic if unicodedata.category(ch) in _MARK_CATEGORIES)
    return re.compile(f"[{re.escape(marks)}]")


def _astral_mark(found: re.Match[str]) -> str:
    return "" if unicodedata.category(found.group()) in _MARK_CATEGORIES else found.group()


# Removed after NFKD (all of them: a test checks every code point).
_MARKS = _bmp_marks()
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
# Lines that NFKD makes a space and a combining mark (so erases below):
# folded first, to the ASCII character they are drawn like.
_LINES_FIRST = str.maketrans(
    {
        "\u2017": "=",  # double low line
        "\u2261": "=",  # identical to (three bars)
        "\u00af": "-",  # macron
        "\u203e": "-",  # overline
        "\ufe49": "-",  # dashed, centreline, wavy, double wavy overline
        "\ufe4a": "-",
        "\ufe4b": "-",
        "\ufe4c": "-",
        "\uffe3": "-",  # full-width macron
        "\u02dc": "~",  # small tilde
    }
)
# Every whitespace character but the newline: all of category Zs, the tab.
_SPACES = re.compile(r"[^\S\n]")
# Category Pd (Unicode 15; a test checks it against unicodedata), and the
# minus signs and hyphen bullet that look the same.
DASHES = (
    "\u002d\u058a\u05be\u1400\u1806\u2010-\u2015\u2e17\u2e1a\u2e3a\u2e3b\u2e40\u2e5d"
    "\u301c\u3030\u30a0\ufe31\ufe32\ufe58\ufe63\uff0d\U00010ead"
    "\u2212\u2796\u2043"
)
# The box-drawing horizontals, light, heavy, dashed and double (the block's
# rule is U+2550), and the half lines.
_HORIZONTALS = "\u2500\u2501\u2504\u2505\u2508\u2509\u254c\u254d\u2550\u2574-\u257f"


def _range_map(ranges: str, to: str) -> dict[int, str]:
    """Every character of `ranges` (written as in a regex class: "a-c" is a
    range; a "-" with no character before it is itself) mapped to `to`."""
    chars = re.findall(r".-.|.", ranges, re.DOTALL)
    table: dict[int, str] = {}
    for item in chars:
        first, last = (item[0], item[2]) if len(item) == 3 else (item, item)
        table.update(dict.fromkeys(range(ord(first), ord(last) + 1), to))
    return table


# Letters that read as Latin ones, and ornamental brackets: each character of
# _LOOKALIKE_FROM becomes the one at the same place in _LOOKALIKE_TO.
_LOOKALIKE_FROM = (
    # Cyrillic
    "\u0410\u0412\u0415\u0405\u0406\u0408\u041a\u041c\u041d\u041e\u0420\u0421"
    "\u0422\u0423\u0425\u04ae\u051a\u051c\u0430\u0435\u043e\u0440\u0441\u0443"
    "\u0445\u0455\u0456\u0458\u0501\u051b\u051d\u04af\u04bb\u04cf\u04c0"
    # Greek
    "\u0391\u0392\u0395\u0396\u0397\u0399\u039a\u039c\u039d\u039f\u03a1\u03a4"
    "\u03a5\u03a7\u03bf\u03bd\u03c1\u03b9\u03c5\u03f2\u03f9"
    # Armenian, Cherokee
    "\u0555\u0585\u057d\u054d\u13ac\u13b7\u13a1\u13da\u13e2\u13de\u13a5\u13b3"
    "\u13aa\u13df\u13ab\u13bb"
    # Latin small capitals and other letters read as Latin ones
    "\u1d00\u0299\u1d04\u1d05\u1d07\u0493\u0262\u029c\u026a\u1d0a\u1d0b\u029f"
    "\u1d0d\u0274\u1d0f\u1d18\u0280\ua731\u1d1b\u1d1c\u1d20\u1d21\u028f\u1d22"
    "\u0131\u0237\u2113"
    # Ornamental and CJK brackets
    "\u2768\u276a\u27ee\u2e28\ufd3e\u2769\u276b\u27ef\u2e29\ufd3f\u27e6\u2772"
    "\u3014\u3010\u3016\u3018\u298b\u27e7\u2773\u3015\u3011\u3017\u3019\u298c"
)
_LOOKALIKE_TO = (
    # Cyrillic
    "ABESIJKMHOPC"
    "TYXYQWaeopcy"
    "xsijdqwyhlI"
    # Greek
    "ABEZHIKMNOPT"
    "YXovpiucC"
    # Armenian, Cherokee
    "OouUEMRSPLiW"
    "ACJH"
    # Latin small capitals and other letters read as Latin ones
    "ABCDEFGHIJKL"
    "MNOPRSTUVWYZ"
    "ijl"
    # Ornamental and CJK brackets
    "((((()))))[["
    "[[[[[]]]]]]]"
)
_FOLD: dict[int, str] = {
    **_range_map(DASHES, "-"),
    **_range_map(_HORIZONTALS, "-"),
    **{ord(a): b for a, b in zip(_LOOKALIKE_FROM, _LOOKALIKE_TO, strict=True)},
    # The braille blank is a symbol, but renders as a space.
    0x2800: " ",
}


def normalise(text: str) -> str:
    """The text in the normalised form above (line breaks kept, one per line)."""
    text = SELECTORS.sub("", IGNORABLE.sub("", lines(text))).translate(_LINES_FIRST)
    text = _ASTRAL.sub(_astral_mark, _MARKS.sub("", unicodedata.normalize("NFKD", text)))
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text)).translate(_FOLD)


# A rule: three or more of these and nothing else (spaces aside): dashes and
# the box-drawing horizontals (folded to "-" above), the one-eighth blocks
# drawn as a line at the bottom or top, bars, and characters drawn as a
# line. Not corners, tees, verticals or other blocks: a table's border
# ("┌──┬──┐") or a progress bar ("██████░░░░") imitates no rule.
_RULE = re.compile("[-=_~*\u2581\u2594\u25ac\u25ad\u23af\u23e4\u3013\u30fc\u4e00\u3161]{3,}")
# A tier header ("MEMORY (agent notes) [42% — 924/2,200 chars]", "USER
# PROFILE (who the user is) [3 entries]"), read with its spaces removed
# ("M E M O R Y" too), Markdown around it stripped, and in lower case: the
# tier's name, then a label in parentheses, a bracket, or both.
_HEADER = re.compile(r"(memory|user[-_]?profile)(\(.{0,200}?\))?(\[[^\]]{0,200}\])?")
_OWN_NAMES = ("(agentnotes)", "(whotheuseris)")
# Markdown around a header (heading, emphasis, list item, quote, code span)
# still shows it: "## USER PROFILE ...", "**MEMORY ...**", "- MEMORY ...".
_MARKUP_BEFORE = re.compile(r"^(?:[#*>`_~+\u2022-]|\d{1,9}[.)])+")
_MARKUP_AFTER = re.compile(r"[#*`_~]+$")
# The block's own usage summaries, "[42%-924/2,200chars]" and "[1,234entries,
# 12shown]" as the normalised form writes them.
_SUMMARY = re.compile(r"\[\d[\d,]*%.{0,40}chars\]|\[\d[\d,]*entr(y|ies)(,\d[\d,]*shown)?\]")


def _forged(written: str, folded: str) -> bool:
    """Whether one line reads as a rule, a separator or a tier header."""
    compact = folded.replace(" ", "")
    if compact == "§":
        return True
    if _RULE.fullmatch(compact):
        # A rule written in ASCII is Markdown ("---", "***", a setext
        # underline): it imitates nothing the block draws.
        visible = _SPACES.sub("", SELECTORS.sub("", IGNORABLE.sub("", written)))
        return not visible.isascii()
    compact = _MARKUP_AFTER.sub("", _MARKUP_BEFORE.sub("", compact, count=1))
    header = _HEADER.match(compact.lower())
    if header is None:
        return False
    label, summary = header.group(2), header.group(3)
    if label in _OWN_NAMES:
        return True
    # Another label or none: a header only with a bracket holding a usage
    # summary, or, with the name in capitals as the block writes it, any
    # bracket ending the line (so "memory(buf)[0] is the first byte" is code
    # and "Memory (JVM) [-Xmx2g]" a note).
    if summary is None:
        return False
    capitals = compact[: len(header.group(1))].isupper()
    return _SUMMARY.fullmatch(summary) is not None or (capitals and header.end() == len(compact))


def _may_name_a_tier(text: str) -> bool:
    """Whether an ASCII text may hold a header: the common case, cheaply. In
    ASCII a rule is Markdown and "§" cannot be written, so only a header can
    be forged, and it names its tier, read as `_forged` reads it: with every
    space removed ("M E M O R Y") and in lower case."""
    compact = "".join(text.split()).lower()
    return "memory" in compact or "profile" in compact


def forged_line(text: str) -> str | None:
    """The first line of the text that reads as the block's layout, or None."""
    if text.isascii() and not _may_name_a_tier(text):
        return None
    written_lines = lines(text).split("\n")
    for written, folded in zip(written_lines, normalise(text).split("\n"), strict=True):
        if _forged(written, folded):
            return written
    return None


def neutralise(text: str) -> str:
    """The text with every line that reads as the block's layout put in
    brackets, so an entry can never add a rule, header or separator to the
    frozen block (what `content_scanning: off` shows)."""
    written_lines = lines(text).split("\n")
    folded_lines = normalise(text).split("\n")
    return "\n".join(
        f"[{written.strip()}]" if _forged(written, folded) else written
        for written, folded in zip(written_lines, folded_lines, strict=True)
    )
