"""A verifiable multi-step task that needs no download: generated arithmetic word problems.

A problem starts from a number and applies a few operations; its solution writes one line per operation,
"a op b = c" (or, shown worked and longer, "a op b = <an expression in + and - worth c> = c"), then
"answer: c". A program checks every step (right operands, right result), which makes an exact
verifier for search, and solutions are training traces for a small policy. Text is tokenised character by
character with CharTokenizer.
"""
import operator
import random
import re
from dataclasses import dataclass

NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay")
THINGS = ("apples", "coins", "books", "shells", "stamps")
VERBS = {"+": "gets {} more", "-": "gives away {}", "*": "multiplies them by {}"}
APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class Problem:
    start: int
    ops: tuple                # ((op, operand), ...)
    text: str

    def results(self):
        """The running value after each operation."""
        values, value = [], self.start
        for op, operand in self.ops:
            value = APPLY[op](value, operand)
            values.append(value)
        return values

    def solution(self, rng=None, worked=0.0):
        """Step lines "a op b = c" and the final "answer: c", each ending in a newline.

        With probability `worked` (drawn from rng, a random.Random) a line shows its work instead, which makes it
        longer: "a + b = a + b1 + b2 = c" / "a - b = a - b1 - b2 = c" with b split in two, "a * b = a + ... + a = c".
        """
        lines, value = [], self.start
        for (op, operand), result in zip(self.ops, self.results()):
            work = f" = {_worked(value, op, operand)}" if rng is not None and rng.random() < worked else ""
            lines.append(f"{value} {op} {operand}{work} = {result}\n")
            value = result
        return lines + [f"answer: {value}\n"]


def _worked(value, op, operand):
    """The middle of a worked step: the operation written with + and - only."""
    if op == "*":
        return " + ".join([str(value)] * operand)
    half = operand // 2
    parts = [operand - half, half] if half else [operand]
    return f" {op} ".join([str(value)] + [str(p) for p in parts])


def _evaluate(expression):
    """The value of "n op n op ..." with + and - only, left to right; None if it is anything else."""
    tokens = expression.split(" ")
    if len(tokens) % 2 == 0 or not all(re.fullmatch(r"[0-9]+", t) for t in tokens[::2]):
        return None
    value = int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op not in "+-" or len(op) != 1:
            return None
        value = APPLY[op](value, int(number))
    return value


def make_problem(rng, steps=3, max_start=20):
    """A random problem with `steps` operations whose running values stay in 0..999."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    start = rng.randint(1, max_start)
    value, ops, sentences = start, [], [f"{name} has {start} {thing}."]
    while len(ops) < steps:
        op = rng.choice("+-*")
        operand = rng.randint(2, 5) if op == "*" else rng.randint(1, 20)
        nxt = APPLY[op](value, operand)
        if 0 <= nxt <= 999:
            ops.append((op, operand))
            sentences.append(f"Then {name} {VERBS[op].format(operand)}.")
            value = nxt
    return Problem(start, tuple(ops), " ".join(sentences) + f" How many {thing}?\n")


def make_problems(count, seed=0, steps=3):
    rng = random.Random(seed)
    return [make_problem(rng, steps) for _ in range(count)]


def check_step(problem, previous_steps, step):
    """1.0 if `step` (text) is a correct next line of the problem's solution given the steps so far, else 0.0.

    Steps are judged on their content: "a op b = c" with the right operation, operands and result, optionally
    with worked middles ("= <expression with + and -> =") that each equal the result; or "answer: c" once every
    operation is done. A step after a wrong one is wrong.
    """
    index = len(previous_steps)
    if index > len(problem.ops) or not all(_correct(problem, i, s) for i, s in enumerate(previous_steps)):
        return 0.0
    return 1.0 if _correct(problem, index, step) else 0.0


def _correct(problem, index, step):
    values = [problem.start] + problem.results()
    text = step.strip()
    if index == len(problem.ops):
        return text == f"answer: {values[-1]}"
    op, operand = problem.ops[index]
    parts = text.split(" = ")
    return (len(parts) >= 2 and parts[0] == f"{values[index]} {op} {operand}" and parts[-1] == str(values[index + 1])
            and all(_evaluate(middle) == values[index + 1] for middle in parts[1:-1]))


def extract_answer(text):
    """The integer after the last "answer:", or None."""
    head, sep, tail = text.rpartition("answer:")
    if not sep:
        return None
    number = tail.strip().split("\n")[0].strip()
    return int(number) if re.fullmatch(r"-?[0-9]+", number) else None


class CharTokenizer:
    """Characters to ids over a fixed alphabet; id 0 is the end of sequence."""

    ALPHABET = "\n abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:?+-*="

    def __init__(self):
        self.ids = {c: i + 1 for i, c in enumerate(self.ALPHABET)}
        self.eos_token_id = 0
        self.newline_id = self.ids["\n"]

    def __len__(self):
        return len(self.ALPHABET) + 1

    def encode(self, text):
        unknown = set(text) - set(self.ids)
        if unknown:
            raise ValueError(f"characters outside the alphabet: {sorted(unknown)}")
        return [self.ids[c] for c in text]

    def decode(self, ids):
        return "".join(self.ALPHABET[i - 1] for i in ids if 0 < i <= len(self.ALPHABET))
