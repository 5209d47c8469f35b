"""Offline prompt sources: Jane Austen's novels (Debian's r-cran-janeaustenr, read with the
`rdata` package) and Python's own standard-library source, turned into a mixed prompt set.

Most prompts are chat-formatted instructions because most real traffic to an instruct target is
chat; a minority are raw text continuations so the draft also sees plain prose and code.
"""
from __future__ import annotations

import random
import sysconfig
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

from tandem.models import ModelError

AUSTEN_DB = Path("/usr/lib/R/site-library/janeaustenr/data/Rdata")

_PROSE_TEMPLATES = (
    "Continue this passage:\n\n{x}",
    "Summarise this passage in two sentences:\n\n{x}",
    "Rewrite this passage in modern, simple English:\n\n{x}",
    "What is happening in this passage? Who are the characters?\n\n{x}",
    "Write a short reply to this letter as if you were the recipient:\n\n{x}",
    "List three adjectives that describe the mood of this passage and explain why:\n\n{x}",
    "Translate the main idea of this passage into a tweet:\n\n{x}",
)
_CODE_TEMPLATES = (
    "Explain what this code does:\n\n```python\n{x}\n```",
    "Find possible bugs in this Python code:\n\n```python\n{x}\n```",
    "Write a docstring for this code:\n\n```python\n{x}\n```",
    "Rewrite this code to be more readable:\n\n```python\n{x}\n```",
    "Write a unit test for this function:\n\n```python\n{x}\n```",
)
_TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "inflation", "vaccines",
    "machine learning", "the water cycle", "plate tectonics", "the stock market", "DNA",
    "climate change", "the Roman Empire", "electric cars", "sleep", "the immune system",
    "recursion", "compound interest", "the internet", "volcanoes", "bees", "gravity",
    "democracy", "coffee", "the moon landing", "antibiotics", "renewable energy", "chess",
    "the printing press", "earthquakes", "hash tables", "sorting algorithms", "rainbows",
    "the Great Wall of China", "supply and demand", "meditation", "the human heart",
)
_QUESTION_TEMPLATES = (
    "What is {t}?", "Explain {t} to a ten-year-old.", "Give me three facts about {t}.",
    "Write a short paragraph about {t}.", "What are the pros and cons of {t}?",
    "Write a haiku about {t}.", "How does {t} work?", "Why is {t} important?",
    "Write a short story that involves {t}.", "Give me a quiz question about {t}.",
)


# General chat ("chat" mix): everyday assistant requests, the bulk of real traffic.
_TASKS = (
    "Give me some tips for {s}.", "What should a beginner know about {s}?",
    "Write a short email to a friend about {s}.", "Explain {s} in simple words.",
    "Write a short poem about {s}.", "What are common mistakes people make with {s}?",
    "Make a step-by-step plan for {s}.", "Write a short story about {s}.",
    "Summarise the key ideas of {s} in a few bullet points.", "Is {s} a good idea? Why?",
    "Write a product description related to {s}.", "Tell me an interesting fact about {s}.",
    "Compare two different approaches to {s}.", "Write a short dialogue about {s}.",
    "What questions should I ask before starting {s}?", "Give me a checklist for {s}.",
    "Describe a typical day involving {s}.", "Write a formal letter about {s}.",
    "What is the history of {s}?", "How would you teach {s} to a child?",
    "How does {s} work?", "Why is {s} important?", "What are the pros and cons of {s}?",
    "Give me three ideas involving {s}.", "Write a limerick about {s}.",
    "Explain {s} with an example.", "What is the difference between {s} and {t}?",
    "List five facts about {s}.", "Write a short blog post introduction about {s}.",
    "How can I get better at {s}?",
)
_SUBJECTS = (
    "cooking pasta", "learning the guitar", "saving for retirement", "running a marathon",
    "growing tomatoes", "writing a CV", "public speaking", "travelling on a budget",
    "training a puppy", "time management", "baking bread", "starting a small business",
    "learning Spanish", "moving to a new city", "painting with watercolours", "camping",
    "job interviews", "recycling at home", "online privacy", "first aid", "cycling to work",
    "reading more books", "organising a wedding", "home workouts", "caring for houseplants",
    "writing a novel", "negotiating a salary", "photography", "studying for exams",
    "making friends as an adult", "buying a used car", "renting a flat", "volunteering",
    "reducing stress", "learning to swim", "a rainy weekend", "a school science fair",
    "chess openings", "a birthday surprise", "debugging a program", "using spreadsheets",
    "writing clean code", "learning statistics", "space exploration", "the ocean",
    "ancient Egypt", "electric bikes", "solar panels", "healthy eating", "coffee brewing",
    "a visit to the dentist", "the first day at school", "winter holidays", "a football match",
    "photosynthesis", "volcanoes", "the water cycle", "black holes", "the human heart",
    "vaccines", "climate change", "the Roman Empire", "the printing press", "electricity",
    "Python lists", "recursion", "sorting algorithms", "HTML and CSS", "SQL databases",
    "machine learning", "the internet", "encryption", "git branches", "unit testing",
    "inflation", "credit cards", "supply and demand", "democracy", "the French Revolution",
    "honey bees", "octopuses", "dinosaurs", "the Moon", "rainbows", "earthquakes",
    "meditation", "yoga", "vegetarian cooking", "chocolate", "jazz music", "chess",
    "the Olympic Games", "museums", "trains", "bridges", "sleep", "dogs", "coral reefs",
)


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat messages (rendered with the target's template) or raw text."""

    kind: str  # "chat" or "raw"
    text: str
    source: str  # "austen", "code" or "question"

    def __post_init__(self):
        if self.kind not in ("chat", "raw") or not self.text:
            raise ValueError(f"bad prompt kind={self.kind!r} or empty text")


def _read_rdb_object(rdb: bytes, pos: int, length: int):
    import rdata

    # An R lazy-load database: each object is a 4-byte big-endian length + zlib stream of an
    # R serialisation, which `rdata` parses once decompressed.
    blob = zlib.decompress(rdb[pos + 4:pos + length])
    return rdata.conversion.convert(rdata.parser.parse_data(blob))


def austen_paragraphs(db: Path = AUSTEN_DB, min_chars: int = 200) -> list[str]:
    """Paragraphs of the six novels (lines joined; blank lines separate paragraphs)."""
    try:
        import rdata
    except ImportError as exc:
        raise ModelError("the `rdata` package is needed to read janeaustenr") from exc
    rdx, rdb = db.with_suffix(".rdx"), db.with_suffix(".rdb")
    if not rdx.is_file() or not rdb.is_file():
        raise ModelError(f"{db}.rd[bx] not found: `apt-get install r-cran-janeaustenr`")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns about the unusual file extensions
        index = rdata.read_rds(str(rdx))
        data = rdb.read_bytes()
        paragraphs: list[str] = []
        for pos, length in index["variables"].values():
            lines = _read_rdb_object(data, int(pos), int(length))
            paragraphs.extend(_join_paragraphs([str(x) for x in lines]))
    return [p for p in paragraphs if len(p) >= min_chars]


def _join_paragraphs(lines: list[str]) -> list[str]:
    out, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def stdlib_snippets(max_files: int = 400, lines: int = 14, seed: int = 0) -> list[str]:
    """Chunks of Python standard-library source (function-sized), deterministic for a seed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    if not files:
        raise ModelError(f"no Python standard-library sources under {root}")
    rng = random.Random(seed)
    rng.shuffle(files)
    snippets = []
    for f in files[:max_files]:
        src = f.read_text(errors="replace").splitlines()
        starts = [i for i, ln in enumerate(src) if ln.lstrip().startswith(("def ", "class "))]
        for s in rng.sample(starts, min(3, len(starts))):
            chunk = "\n".join(src[s:s + lines]).strip()
            if len(chunk) > 120:
                snippets.append(chunk)
    return snippets


def _clip(text: str, rng: random.Random, lo: int = 150, hi: int = 500) -> str:
    """A prefix of `text` of lo..hi characters, cut at a word boundary."""
    n = rng.randint(lo, hi)
    return text if len(text) <= n else text[:n].rsplit(" ", 1)[0]


def chat_prompts(n: int, seed: int) -> list[Prompt]:
    """Everyday chat requests (task template x subject), deterministic for a seed; distinct
    while the combinations last (greedy answers to a repeated prompt teach nothing new)."""
    rng = random.Random(seed)
    out, seen = [], set()
    for _ in range(50 * n):
        if len(out) == n:
            break
        s, t = rng.sample(_SUBJECTS, 2)
        text = rng.choice(_TASKS).format(s=s, t=t)
        if text not in seen or len(seen) >= n:
            seen.add(text)
            out.append(Prompt("chat", text, "chat"))
    return out


def build_prompts(n: int, seed: int, chat_fraction: float = 0.85,
                  mix: str = "corpus") -> list[Prompt]:
    """A deterministic prompt set. mix="corpus": chat about Austen / code / topic questions
    plus raw text; mix="chat": everyday chat requests only."""
    if n < 1 or not 0 <= chat_fraction <= 1:
        raise ValueError(f"need n >= 1 and chat_fraction in [0, 1], got {n}, {chat_fraction}")
    if mix == "chat":
        return chat_prompts(n, seed)
    if mix != "corpus":  # "self" needs the target: tools.distill.self_prompts
        raise ValueError(f"prompt mix must be 'corpus' or 'chat' here, got {mix!r}")
    rng = random.Random(seed)
    prose, code = austen_paragraphs(), stdlib_snippets(seed=seed)
    prompts = []
    for _ in range(n):
        r = rng.random()
        if rng.random() >= chat_fraction:  # raw continuation: plain prose or code
            src, text = ("austen", _clip(rng.choice(prose), rng)) if r < 0.6 else \
                ("code", rng.choice(code))
            prompts.append(Prompt("raw", text, src))
        elif r < 0.4:
            tpl = rng.choice(_PROSE_TEMPLATES)
            prompts.append(Prompt("chat", tpl.format(x=_clip(rng.choice(prose), rng)), "austen"))
        elif r < 0.7:
            prompts.append(Prompt("chat", rng.choice(_CODE_TEMPLATES).format(
                x=rng.choice(code)), "code"))
        else:
            q = rng.choice(_QUESTION_TEMPLATES).format(t=rng.choice(_TOPICS))
            prompts.append(Prompt("chat", q, "question"))
    return prompts


def encode_prompt(tokenizer, prompt: Prompt, max_tokens: int = 256) -> list[int]:
    """Token ids as the target would see them (chat template for chat prompts)."""
    if prompt.kind == "chat" and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(prompt.text).input_ids
    return list(ids)[-max_tokens:]  # keep the end: that is where generation continues
