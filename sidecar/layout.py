"""The frozen block's layout, as an entry could imitate it: a rule, a lone
entry separator, a tier header. Found on a normalised form of each line, so
no spelling of one gets through (issue 25: a no-break space between USER and
PROFILE was enough).

The normalised form of a line, used for this check only (the entry is stored
and shown as written):

- line breaks: CR, CRLF, U+2028 and U+2029 end a line, as a renderer shows;
- removed: format characters (Unicode category Cf: zero-width space, ZWNJ,
  ZWJ, word joiner, BOM, bidi controls, tags ...), the other
  default-ignorable code points, variation selectors, and combining marks
  of the Latin lookalike ranges ("ÚSER", "U\u0332SER");
- NFKC: full-width, mathematical and other compatibility letters and
  brackets become ASCII;
- every Unicode space (category Zs: U+00A0, U+2000-U+200A, U+202F, U+205F,
  U+3000 ...) and the tab become a plain space;
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

# Every Cf character of Unicode 15 (tests/test_scanner.py checks this
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


# Combining marks a forger can put on Latin letters and still be read as
# them: diacritics, their extensions and supplement, the marks for symbols
# (enclosing circles, strokes) and the half marks. Removed after NFKD.
_MARKS = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")
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
    chars = re.findall(r".-.|.", ranges, re.DOTALL)
    table: dict[int, str] = {}
    for item in chars:
        first, last = (item[0], item[2]) if len(item) == 3 else (item, item)
        table.update(dict.fromkeys(range(ord(first), ord(last) + 1), to))
    return table


_LOOKALIKES = {
    # Cyrillic
    "А": "A", "В": "B", "Е": "E", "Ѕ": "S", "І": "I", "Ј": "J", "К": "K", "М": "M",
    "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T", "У": "Y", "Х": "X", "Ү": "Y",
    "Ԛ": "Q", "Ԝ": "W", "а": "a", "е": "e", "о": "o", "р": "p", "с": "c", "у": "y",
    "х": "x", "ѕ": "s", "і": "i", "ј": "j", "ԁ": "d", "ԛ": "q", "ԝ": "w", "ү": "y",
    "һ": "h", "ӏ": "l", "Ӏ": "I",
    # Greek
    "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M",
    "Ν": "N", "Ο": "O", "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X", "ο": "o", "ν": "v",
    "ρ": "p", "ι": "i", "υ": "u", "ϲ": "c", "Ϲ": "C",
    # Armenian, Cherokee
    "Օ": "O", "օ": "o", "ս": "u", "Ս": "U", "Ꭼ": "E", "Ꮇ": "M", "Ꭱ": "R", "Ꮪ": "S",
    "Ꮲ": "P", "Ꮮ": "L", "Ꭵ": "i", "Ꮃ": "W", "Ꭺ": "A", "Ꮯ": "C", "Ꭻ": "J", "Ꮋ": "H",
    # Latin small capitals and other letters read as Latin ones
    "ᴀ": "A", "ʙ": "B", "ᴄ": "C", "ᴅ": "D", "ᴇ": "E", "ғ": "F", "ɢ": "G", "ʜ": "H",
    "ɪ": "I", "ᴊ": "J", "ᴋ": "K", "ʟ": "L", "ᴍ": "M", "ɴ": "N", "ᴏ": "O", "ᴘ": "P",
    "ʀ": "R", "ꜱ": "S", "ᴛ": "T", "ᴜ": "U", "ᴠ": "V", "ᴡ": "W", "ʏ": "Y", "ᴢ": "Z",
    "ı": "i", "ȷ": "j", "ℓ": "l",
    # Ornamental and CJK brackets
    "❨": "(", "❪": "(", "⟮": "(", "⸨": "(", "﴾": "(", "❩": ")", "❫": ")", "⟯": ")",
    "⸩": ")", "﴿": ")", "⟦": "[", "❲": "[", "〔": "[", "【": "[", "〖": "[", "〘": "[",
    "⦋": "[", "⟧": "]", "❳": "]", "〕": "]", "】": "]", "〗": "]", "〙": "]", "⦌": "]",
}  # fmt: skip
_FOLD = str.maketrans(
    {
        **_range_map(DASHES, "-"),
        **_range_map(_HORIZONTALS, "-"),
        **{ord(k): v for k, v in _LOOKALIKES.items()},
    }
)


def normalise(text: str) -> str:
    """The text in the normalised form above (line breaks kept, one per line)."""
    text = SELECTORS.sub("", IGNORABLE.sub("", lines(text)))
    text = _MARKS.sub("", unicodedata.normalize("NFKD", text))
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text)).translate(_FOLD)


# A rule: three or more of these and nothing else (spaces aside): dashes and
# the box-drawing horizontals (folded to "-" above), the other box-drawing
# characters and block elements, bars, and characters drawn as a line.
_RULE = re.compile(
    "[-=_~*\u2500-\u259f\u25ac\u25ad\u23af\u23e4\u2013\u3013\u30fc\u4e00\u3161"
    "\u2e3a\u2e3b\u2581\u2594]{3,}"
)
# A tier header ("MEMORY (agent notes) [42% — 924/2,200 chars]", "USER
# PROFILE (who the user is) [3 entries]"), read with its spaces removed and
# in lower case: the tier's name, then a label in parentheses, a bracket, or
# both.
_HEADER = re.compile(r"(memory|user[-_]?profile)(\(.{0,200}?\))?(\[[^\]]{0,200}\])?")
_OWN_NAMES = ("(agentnotes)", "(whotheuseris)")
_SUMMARY = re.compile(r"\d.*(%|chars|entr|shown)")


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
    header = _HEADER.match(compact.lower())
    if header is None:
        return False
    label, summary = header.group(2), header.group(3)
    if label in _OWN_NAMES:
        return True
    # Another label or none: a header only with a bracket, ending the line
    # or holding a usage summary (so "memory(buf)[0] is the first byte" is
    # code, not a header).
    return summary is not None and (
        header.end() == len(compact) or _SUMMARY.search(summary) is not None
    )


def forged_line(text: str) -> str | None:
    """The first line of the text that reads as the block's layout, or None."""
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
