"""Compose the small training text (fables.txt) for the character-level convergence run.

    .venv/bin/python benchmarks/fewbit/data/make_text.py

Original text written for this repository (public domain / CC0): a hand-written preface
followed by short fables generated from a hand-written grammar with a fixed seed.
"""
from __future__ import annotations

import pathlib
import random

PREFACE = """\
THE BOOK OF SMALL FABLES

These little stories were written for a machine that learns to spell. They are plain on
purpose: the same creatures walk the same roads, and the same lessons return in new
clothes, so that a small model can find the rhythm of the words before it finds their
meaning. Read them aloud if you like; they were made to be repeated.

In the valley below the old mill there was a river that ran quickly in spring and slowly
in autumn. Along its banks lived many animals, and each of them believed that it alone
understood the river. The heron watched it, the otter swam in it, the miller used it, and
the stones at the bottom said nothing at all. Every year the water rose and fell, and every
year the animals told one another what it meant.
"""

ANIMALS = ["fox", "heron", "otter", "hare", "badger", "crow", "tortoise", "mouse", "owl",
           "wolf", "lamb", "goat", "sparrow", "beaver", "frog", "stag", "weasel", "mole"]
ADJ = ["clever", "patient", "proud", "hungry", "careful", "quick", "old", "young", "quiet",
       "boastful", "gentle", "tired", "curious", "stubborn", "honest", "foolish"]
PLACES = ["by the river", "under the oak tree", "at the edge of the wheat field",
          "on the hill behind the mill", "near the old stone bridge", "in the reeds",
          "beside the frozen pond", "at the crossroads", "in the orchard", "below the cliff"]
THINGS = ["a golden apple", "a round loaf of bread", "a silver key", "a basket of plums",
          "a warm coat", "a bright feather", "a jar of honey", "a lantern", "a map",
          "a handful of seeds", "a broken bell", "a cup of milk"]
TIMES = ["One morning", "Late one evening", "On the first day of winter", "In the heat of summer",
         "After a long rain", "When the moon was full", "Early in the spring", "At harvest time"]
VERBS = ["found", "stole", "was given", "traded for", "dug up", "carried home", "guarded"]
SAY = ["said", "cried", "whispered", "laughed", "answered", "declared", "muttered"]
MORALS = [
    "Patience is worth more than speed.",
    "He who boasts of the river has never crossed it.",
    "A gift shared is a gift kept.",
    "The quiet listener learns the most.",
    "Do not count the plums before the tree has flowered.",
    "Many small steps cross the widest field.",
    "A friend in the rain is better than a crowd in the sun.",
    "What is taken in haste is lost at leisure.",
    "The proud stag drinks last at the pond.",
    "Honest words are plain, and plain words are strong.",
]


def a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def fable(rng: random.Random, n: int) -> str:
    x, y = rng.sample(ANIMALS, 2)
    ax, ay = rng.sample(ADJ, 2)
    thing, place, time_ = rng.choice(THINGS), rng.choice(PLACES), rng.choice(TIMES)
    v, s1, s2 = rng.choice(VERBS), rng.choice(SAY), rng.choice(SAY)
    moral = rng.choice(MORALS)
    lines = [
        f"{n}. THE {ax.upper()} {x.upper()} AND THE {ay.upper()} {y.upper()}",
        "",
        f"{time_}, {a(ax)} {x} {v} {thing} {place}. "
        f"{a(ay).capitalize()} {y} saw it and came closer.",
        f"\"That is a fine thing,\" {s1} the {y}. \"Will you share it with me?\"",
    ]
    if rng.random() < 0.5:
        lines += [
            f"\"No,\" {s2} the {x}, \"it is mine, and I will keep it {place}.\"",
            f"So the {x} sat alone and guarded {thing} all night, and in the morning it was "
            f"too tired to enjoy it, while the {y} had slept and was ready for the road.",
        ]
    else:
        lines += [
            f"\"Gladly,\" {s2} the {x}, \"for the night is long and the road is longer.\"",
            f"So they sat together {place}, and when the wind rose they kept each other warm, "
            f"and {thing} lasted them both until the sun came up.",
        ]
    lines += ["", f"Moral: {moral}", "", ""]
    return "\n".join(lines)


def main() -> None:
    rng = random.Random(2024)
    parts = [PREFACE, "\n"]
    n = 1
    while sum(len(p) for p in parts) < 40_000:
        parts.append(fable(rng, n))
        n += 1
    out = pathlib.Path(__file__).with_name("fables.txt")
    out.write_text("".join(parts))
    print(f"wrote {out} ({out.stat().st_size} bytes, {n - 1} fables)")


if __name__ == "__main__":
    main()
