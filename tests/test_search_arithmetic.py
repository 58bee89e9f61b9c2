import random

import pytest

from stree.search.arithmetic import CharTokenizer, check_step, extract_answer, make_problem, make_problems


def test_problems_and_solutions_are_consistent():
    problems = make_problems(200, seed=1)
    assert make_problems(200, seed=1) == problems and make_problems(200, seed=2) != problems
    for p in problems:
        lines = p.solution()
        assert len(lines) == len(p.ops) + 1
        value = p.start
        for (op, operand), line in zip(p.ops, lines):
            a, sym, b, eq, c = line.split()
            assert (int(a), sym, int(b), eq) == (value, op, operand, "=")
            assert int(c) == eval(f"{value} {op} {operand}") and 0 <= int(c) <= 999
            value = int(c)
        assert extract_answer("".join(lines)) == value == p.results()[-1]


def test_check_step_accepts_exactly_the_right_next_line():
    p = make_problem(random.Random(3))
    lines = p.solution()
    for i, line in enumerate(lines):
        assert check_step(p, lines[:i], line) == 1.0
        assert check_step(p, lines[:i], line.strip() + "1\n") == 0.0  # a wrong number
    worked = p.solution(random.Random(0), worked=1.0)
    assert all(len(w) > len(t) for w, t in zip(worked[:-1], lines)) and worked[-1] == lines[-1]
    for i, line in enumerate(worked):
        assert check_step(p, worked[:i], line) == 1.0 and check_step(p, lines[:i], line) == 1.0
    start, op, operand = p.start, *p.ops[0]
    result = p.results()[0]
    for middle in (f"{start} {op} {operand} + 1", f"{start} * {operand}", "", f"{start} {op}"):
        assert check_step(p, [], f"{start} {op} {operand} = {middle} = {result}\n") == 0.0  # a wrong middle
    wrong_first = lines[0].rsplit("=", 1)[0] + "= 1000\n"
    assert check_step(p, [], wrong_first) == 0.0
    assert check_step(p, [wrong_first], lines[1]) == 0.0   # nothing after a wrong step counts
    assert check_step(p, lines, "answer: 3\n") == 0.0       # past the end


@pytest.mark.parametrize("text, want", [("1 + 2 = 3\nanswer: 3\n", 3), ("answer: 12", 12), ("no answer", None),
                                        ("answer: x\n", None), ("answer: 1\nanswer: 7\n", 7)])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    p = make_problem(random.Random(0))
    text = p.text + "".join(p.solution())
    assert tok.decode(tok.encode(text)) == text
    assert tok.newline_id == tok.encode("\n")[0] and tok.eos_token_id == 0 and len(tok) == len(tok.ALPHABET) + 1 == 73
    with pytest.raises(ValueError):
        tok.encode("é")


def test_extract_answer_rejects_malformed_numbers():
    assert extract_answer("answer: --5") is None and extract_answer("answer: -5") == -5
