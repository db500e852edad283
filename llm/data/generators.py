"""Deterministic generators for the embedded default data.

All seeded (`random.Random(seed)`), so the same seed gives the same
records byte for byte:

- `math_problem(rng, level, lang)`: GSM8K-style arithmetic word problems in English
  or Chinese with a worked solution, one step per line, ending in `#### N`:

      Question: Mia has 12 shells. She finds 7 more. How many shells does Mia have now?
      Answer:   12 + 7 = 19
                #### 19

  Levels drive the curriculum: 1 = one step, small numbers (add/subtract within 20);
  2 = one step, two-digit numbers or a times-table product; 3 = two steps;
  4 = three steps with numbers up to a few hundred; 5 = four such steps. The default
  profile trains on levels 1-4 and keeps level 5 for the evaluation's harder tier, which
  nothing trains on (`prepare.harder_levels`).
- `task(rng, kind=None)`: small verifiable instruction tasks (`TASK_KINDS`: reverse,
  uppercase, sort, count words, last word, repeat, max), each with the exact expected answer.
- `arithmetic_question(rng, lang)`: a bare sum the word problems never ask in this form,
  "What is 7 + 5?" or "7 + 5 等于多少？", with its value and a one-step solution in the word
  problems' format (`7 + 5 = 12`, `#### 12`). The evaluation asks `prepare.arithmetic_test`
  of them; SFT trains on `prepare.arithmetic_train` others (none the same calculation).
- `multiturn_conversation(rng, lang, kind)`: two exchanges whose second question reads the
  first (`MULTITURN_KINDS`): an operation on the previous result ("And times 2?" answered
  `12 * 2 = 24`, `#### 24`), a new word problem after an old one, an instruction task after a sum.
- `scope_request(rng, lang, verse)`: a request outside these skills ("Write a poem about the sea."),
  answered by `SCOPE_ANSWER` (`SCOPE_ANSWER_VERSE` where SFT also learns to continue verse), a
  statement of what the model can do; `opening_exchange(rng, lang)` is a first exchange (a sum or
  a word problem, answered) to ask such a request after.
- `context_conversation(rng, lang)`: a word problem or bare calculation asked the way chats
  ask it: after an out-of-scope request answered with `SCOPE_ANSWER`, after an instruction
  task, or under a system message (`SYSTEM_MESSAGES`: "You are terse.", "You are a helpful
  assistant."...), answered as if asked alone.
- `preference_pair(rng, ...)`: the same prompt with a chosen answer (correct and well
  formatted) and a rejected one (a wrong result, or the right result in a broken
  format: no `####` line).

Every answer is computed, never typed in, so `#### N` always equals the worked result
(tests/test_generators.py checks this for thousands of problems).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from llm.config import TASK_KINDS  # the kinds `task` draws, in the order of prepare.task_weights

# ---------------------------------------------------------------------------
# Vocabulary for the word problems

_NAMES_EN = [("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He"), ("Zoe", "She"), ("Sam", "He"),
             ("Lily", "She"), ("Ben", "He"), ("Emma", "She"), ("Jack", "He"), ("Nora", "She"), ("Omar", "He"),
             ("Ivy", "She"), ("Max", "He"), ("Ruby", "She"), ("Noah", "He")]
_ITEMS_EN = ["apples", "shells", "stickers", "marbles", "books", "coins", "pencils", "cards", "stamps",
             "cookies", "flowers", "eggs", "balloons", "candles", "buttons", "oranges"]
_NAMES_ZH = ["小明", "小红", "小华", "小丽", "小刚", "小美", "小强", "小芳", "小军", "小兰"]
_ITEMS_ZH = [("苹果", "个"), ("铅笔", "支"), ("书", "本"), ("贴纸", "张"), ("弹珠", "颗"), ("饼干", "块"),
             ("花", "朵"), ("鸡蛋", "个"), ("气球", "个"), ("邮票", "张"), ("橘子", "个"), ("硬币", "枚")]


@dataclass(frozen=True)
class MathProblem:
    question: str
    steps: tuple[str, ...]   # "12 + 7 = 19" ...
    answer: int
    level: int
    lang: str                # "en" | "zh"

    @property
    def solution(self) -> str:
        return "\n".join(self.steps) + f"\n#### {self.answer}"


# One operation = (symbol, English sentence, Chinese sentence). The sentence describes
# applying the operation with operand n to the running total.
_OPS_EN = {
    "+": ["{P} buys {n} more.", "{P} finds {n} more.", "{P} gets {n} more from a friend."],
    "-": ["{P} gives away {n}.", "{P} loses {n}.", "{P} uses {n} of them."],
    "*": ["Then the number of {items} becomes {n} times as many.", "{P} makes the pile {n} times bigger."],
    "/": ["{P} splits them into {n} equal groups and keeps one group."],
}
_OPS_ZH = {
    "+": ["又买了{n}{u}。", "又找到了{n}{u}。", "朋友又送给{N}{n}{u}。"],
    "-": ["送给别人{n}{u}。", "用掉了{n}{u}。", "丢了{n}{u}。"],
    "*": ["然后{I}的数量变成原来的{n}倍。"],
    "/": ["把它们平均分成{n}份，留下其中一份。"],
}


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    assert a % b == 0, "division problems are generated exact"
    return a // b


def _operand(rng: random.Random, total: int, op: str, hi: int) -> int | None:
    """An operand that keeps the running total a non-negative whole number."""
    if op == "+":
        return rng.randint(1, hi)
    if op == "-":
        return rng.randint(1, total) if total >= 1 else None
    if op == "*":
        n = rng.randint(2, 5)
        return n if total * n <= hi * 5 else None
    divisors = [d for d in range(2, 10) if total % d == 0 and total // d >= 1]
    return rng.choice(divisors) if divisors else None


# Per level: number of steps, the range of the start value and operands, allowed ops.
_LEVELS = {
    1: dict(steps=1, hi=20, ops="+-"),
    2: dict(steps=1, hi=99, ops="+-*"),
    3: dict(steps=2, hi=50, ops="+-*/"),
    4: dict(steps=3, hi=200, ops="+-*/"),
    5: dict(steps=4, hi=200, ops="+-*/"),
}
MAX_LEVEL = max(_LEVELS)


def math_problem(rng: random.Random, level: int, lang: str = "en") -> MathProblem:
    """One word problem at `level` (1..MAX_LEVEL) in `lang` ("en" or "zh")."""
    spec = _LEVELS[level]
    while True:
        hi = spec["hi"]
        if level == 2 and rng.random() < 0.3:
            # a times-table product: "4 bags of 7" is one step
            a, ops, operands = rng.randint(2, 12), ["*"], [rng.randint(2, 9)]
        else:
            a = rng.randint(2, hi)
            ops, operands, total = [], [], a
            for _ in range(spec["steps"]):
                op = rng.choice(spec["ops"])
                n = _operand(rng, total, op, hi)
                if n is None:
                    break
                ops.append(op)
                operands.append(n)
                total = _apply(total, op, n)
            if len(ops) < spec["steps"]:
                continue
        steps, total = [], a
        for op, n in zip(ops, operands):
            new = _apply(total, op, n)
            steps.append(f"{total} {op} {n} = {new}")
            total = new
        question = (_question_en if lang == "en" else _question_zh)(rng, a, ops, operands)
        return MathProblem(question, tuple(steps), total, level, lang)


def _question_en(rng: random.Random, a: int, ops: list[str], operands: list[int]) -> str:
    name, pron = rng.choice(_NAMES_EN)
    items = rng.choice(_ITEMS_EN)
    if ops == ["*"] and rng.random() < 0.5:
        return (f"{name} buys {a} bags with {operands[0]} {items} in each bag."
                f" How many {items} does {name} buy?")
    parts = [f"{name} has {a} {items}."]
    for i, (op, n) in enumerate(zip(ops, operands)):
        s = rng.choice(_OPS_EN[op]).format(P=pron, n=n, items=items)
        parts.append(("Then " + s[0].lower() + s[1:]) if i and not s.startswith("Then") else s)
    parts.append(f"How many {items} does {name} have now?")
    return " ".join(parts)


def _question_zh(rng: random.Random, a: int, ops: list[str], operands: list[int]) -> str:
    name = rng.choice(_NAMES_ZH)
    item, unit = rng.choice(_ITEMS_ZH)
    if ops == ["*"] and rng.random() < 0.5:
        return f"{name}买了{a}袋{item}，每袋有{operands[0]}{unit}。{name}一共买了多少{unit}{item}？"
    parts = [f"{name}有{a}{unit}{item}，"]
    for i, (op, n) in enumerate(zip(ops, operands)):
        s = rng.choice(_OPS_ZH[op]).format(n=n, u=unit, N=name, I=item)
        parts.append(("然后" + s) if i and not s.startswith("然后") else s)
    parts.append(f"现在{name}有多少{unit}{item}？")
    return "".join(parts)


# ---------------------------------------------------------------------------
# Instruction tasks with exact answers

_WORDS = ["castle", "garden", "river", "planet", "window", "silver", "forest", "candle", "bridge", "mirror",
          "winter", "orange", "pencil", "rocket", "island", "meadow", "thunder", "harbor", "lantern", "velvet",
          "crystal", "falcon", "ginger", "marble", "puzzle", "shadow", "timber", "violet", "walnut", "anchor"]


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str
    answer: str
    wrong: str    # a plausible wrong answer of the same kind (for preference pairs)




def task(rng: random.Random, kind: str | None = None) -> Task:
    """One instruction task whose answer is computed exactly; of a random kind unless `kind`
    is given (a random kind costs one draw from `rng` first, as it always has)."""
    if kind is None:
        kind = rng.choice(TASK_KINDS)
    elif kind not in TASK_KINDS:
        raise ValueError(f"task: unknown kind {kind!r}; expected one of {', '.join(TASK_KINDS)}")
    if kind == "reverse":
        w = rng.choice(_WORDS)
        prompt = rng.choice(["Reverse the word: {w}", "Spell {w} backwards."]).format(w=w)
        return Task(kind, prompt, w[::-1], w)
    if kind == "uppercase":
        ws = " ".join(rng.sample(_WORDS, rng.randint(2, 4)))
        return Task(kind, f"Write in capital letters: {ws}", ws.upper(), ws.title())
    if kind == "sort":
        nums = rng.sample(range(1, 100), rng.randint(3, 6))
        shown = ", ".join(map(str, nums))
        return Task(kind, f"Sort these numbers from smallest to largest: {shown}",
                    ", ".join(map(str, sorted(nums))), ", ".join(map(str, sorted(nums, reverse=True))))
    if kind == "count_words":
        ws = rng.sample(_WORDS, rng.randint(2, 8))
        return Task(kind, f"How many words are in this list: {' '.join(ws)}", str(len(ws)),
                    str(len(ws) + rng.choice([-1, 1])))
    if kind == "last_word":
        ws = rng.sample(_WORDS, rng.randint(3, 6))
        return Task(kind, f"What is the last word of: {' '.join(ws)}", ws[-1], ws[0])
    if kind == "repeat":
        w, k = rng.choice(_WORDS), rng.randint(2, 4)
        return Task(kind, f"Repeat the word {w} {k} times.", " ".join([w] * k), " ".join([w] * (k + 1)))
    nums = rng.sample(range(1, 1000), rng.randint(3, 5))
    return Task(kind, f"Which number is the largest: {', '.join(map(str, nums))}", str(max(nums)),
                str(min(nums)))


@dataclass(frozen=True)
class ArithmeticQuestion:
    question: str
    answer: int
    op: str       # "+" | "-" | "*" | "/"
    lang: str     # "en" | "zh"
    expression: str = ""  # "7 + 5": the calculation, the same in both languages

    @property
    def solution(self) -> str:
        """The answer in the word problems' format: the one step, then `#### N`."""
        return f"{self.expression} = {self.answer}\n#### {self.answer}"


def arithmetic_question(rng: random.Random, lang: str = "en") -> ArithmeticQuestion:
    """One bare calculation in the number ranges of levels 1-2: a sum or difference of numbers
    up to 99 (never negative), a times-table product, or an exact division by 2..9."""
    op = rng.choice("+-*/")
    if op == "+":
        a, b = rng.randint(1, 99), rng.randint(1, 99)
    elif op == "-":
        a = rng.randint(2, 99)
        b = rng.randint(1, a)
    elif op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 9)
    else:
        b, q = rng.randint(2, 9), rng.randint(1, 12)
        a = b * q
    q_text = f"What is {a} {op} {b}?" if lang == "en" else f"{a} {op} {b} 等于多少？"
    return ArithmeticQuestion(q_text, _apply(a, op, b), op, lang, f"{a} {op} {b}")


def paraphrase_answer(rng: random.Random, answer: str) -> str:
    """The same answer in other words (used to plant same-instruction near-duplicates)."""
    return rng.choice(["The answer is: {a}", "Here it is: {a}", "Sure. {a}", "{a}"]).format(a=answer)


# ---------------------------------------------------------------------------
# Preference pairs

def broken_format(solution: str, answer: int, rng: random.Random) -> str:
    """The right result without the required `#### N` line."""
    body = solution.rsplit("\n#### ", 1)[0]
    return rng.choice([f"{body}\nThe answer is {answer}.", f"{body}\n{answer}", f"{body}", f"{answer}"])


def wrong_solution(problem: MathProblem, rng: random.Random) -> str:
    """A well-formatted solution with an arithmetic slip carried to the end."""
    for _ in range(100):
        text = _slip(problem, rng)
        if not text.endswith(f"#### {problem.answer}"):
            return text
    raise AssertionError(f"could not make a wrong solution for {problem}")


def _slip(problem: MathProblem, rng: random.Random) -> str:
    k = rng.randrange(len(problem.steps))
    steps, total = [], None
    for i, s in enumerate(problem.steps):
        lhs, _ = s.split(" = ")
        a_str, op, b_str = lhs.split(" ")
        a = int(a_str) if total is None else total
        b = int(b_str)
        value = _apply(a, op, b) if op != "/" or a % b == 0 else a // b
        if i == k:
            delta = rng.choice([-10, -2, -1, 1, 2, 10, rng.randint(3, 9)])
            value = value + delta if value + delta >= 0 else value + abs(delta)
        steps.append(f"{a} {op} {b} = {value}")
        total = value
    return "\n".join(steps) + f"\n#### {total}"


def preference_pair(rng: random.Random, level: int, lang: str, broken_fraction: float) -> dict:
    """A math prompt with chosen (correct, formatted) and rejected (wrong or unformatted) answers."""
    p = math_problem(rng, level, lang)
    if rng.random() < broken_fraction:
        rejected, kind = broken_format(p.solution, p.answer, rng), "broken_format"
    else:
        rejected, kind = wrong_solution(p, rng), "wrong_answer"
    return {"prompt": [{"role": "user", "content": p.question}], "chosen": p.solution,
            "rejected": rejected, "kind": kind, "level": level, "lang": lang}


def task_preference_pair(rng: random.Random) -> dict:
    t = task(rng)
    return {"prompt": [{"role": "user", "content": t.prompt}], "chosen": t.answer, "rejected": t.wrong,
            "kind": f"wrong_{t.kind}", "level": 0, "lang": "en"}


# ---------------------------------------------------------------------------
# Conversations of two exchanges, whose second turn reads the first

MULTITURN_KINDS = ("followup", "new_problem", "task_after_sum")

# A follow-up applies one operation to the previous answer. The operand's placeholder is {n}.
_FOLLOWUPS_EN = {"+": ["Now add {n} to that.", "And plus {n}?", "Add {n} to the result."],
                 "-": ["Now subtract {n} from that.", "And minus {n}?", "Take {n} away from the result."],
                 "*": ["And times {n}?", "Now multiply that by {n}.", "Multiply the result by {n}."],
                 "/": ["And divided by {n}?", "Now divide that by {n}.", "Divide the result by {n}."]}
_FOLLOWUPS_ZH = {"+": ["再加上{n}呢？", "结果再加{n}是多少？"],
                 "-": ["再减去{n}呢？", "结果再减{n}是多少？"],
                 "*": ["再乘以{n}呢？", "结果再乘{n}是多少？"],
                 "/": ["再除以{n}呢？", "结果再除以{n}是多少？"]}


@dataclass(frozen=True)
class Conversation:
    kind: str                      # one of MULTITURN_KINDS
    lang: str                      # the language of the first turn ("en" | "zh")
    messages: tuple[dict, ...]     # user, assistant, user, assistant
    answer: str                    # what the last turn is scored against: the value, or a task's exact answer
    expressions: tuple[str, ...]   # the bare calculations asked in any user turn ("7 + 5"), to keep apart from eval


def _first_turn(rng: random.Random, lang: str, levels: list[int]) -> tuple[str, str, int, str]:
    """(question, solution, value, bare expression or "") of a first turn: a bare calculation
    half the time, else a word problem at one of `levels`."""
    if rng.random() < 0.5:
        q = arithmetic_question(rng, lang)
        return q.question, q.solution, q.answer, q.expression
    p = math_problem(rng, rng.choice(levels), lang)
    return p.question, p.solution, p.answer, ""


def opening_exchange(rng: random.Random, lang: str, levels: tuple[int, ...] = (1, 2, 3, 4)
                     ) -> tuple[tuple[dict, dict], str]:
    """((user, assistant) messages, bare expression or ""): a first exchange, a calculation or a
    word problem answered, as two-exchange conversations open, for a second question of any kind."""
    q, a, _, expr = _first_turn(rng, lang, list(levels))
    return ({"role": "user", "content": q}, {"role": "assistant", "content": a}), expr


def _followup(rng: random.Random, value: int, lang: str) -> tuple[str, str, int]:
    """(follow-up question, its solution, its value): one operation applied to `value`, kept a
    non-negative whole number (a division only where it is exact)."""
    ops = "+*" + ("-" if value >= 1 else "") + ("/" if any(value % d == 0 for d in range(2, 10)) and value else "")
    op = rng.choice(ops)
    if op == "+":
        n = rng.randint(1, 20)
    elif op == "-":
        n = rng.randint(1, min(value, 20))
    elif op == "*":
        n = rng.randint(2, 5)
    else:
        n = rng.choice([d for d in range(2, 10) if value % d == 0])
    new = _apply(value, op, n)
    q = rng.choice((_FOLLOWUPS_EN if lang == "en" else _FOLLOWUPS_ZH)[op]).format(n=n)
    return q, f"{value} {op} {n} = {new}\n#### {new}", new


def multiturn_conversation(rng: random.Random, lang: str = "en", kind: str | None = None,
                           levels: tuple[int, ...] = (1, 2, 3, 4)) -> Conversation:
    """Two exchanges whose second question is read against the first (a random kind unless given):

    - followup: a calculation or word problem, then one operation on its result ("And times 2?",
      "再乘以2呢？"), answered from the previous value: `12 * 2 = 24`, `#### 24`;
    - new_problem: a word problem, then another one that has nothing to do with it: the second
      answer must not reuse the first one's numbers;
    - task_after_sum: a bare calculation, then an instruction task (English: the tasks are),
      answered as the task alone is.
    Every answer is computed; `answer` is the last turn's (a number as text, or the task's answer)."""
    if kind is None:
        kind = rng.choice(MULTITURN_KINDS)
    elif kind not in MULTITURN_KINDS:
        raise ValueError(f"multiturn_conversation: unknown kind {kind!r}; expected one of {', '.join(MULTITURN_KINDS)}")
    if kind == "followup":
        q1, a1, value, expr = _first_turn(rng, lang, list(levels))
        q2, a2, new = _followup(rng, value, lang)
        answer, exprs = str(new), (expr,) if expr else ()
    elif kind == "new_problem":
        p1 = math_problem(rng, rng.choice(levels), lang)
        p2 = math_problem(rng, rng.choice(levels), lang)
        q1, a1, q2, a2, answer, exprs = p1.question, p1.solution, p2.question, p2.solution, str(p2.answer), ()
    else:
        q = arithmetic_question(rng, lang)
        t = task(rng)
        q1, a1, q2, a2, answer, exprs = q.question, q.solution, t.prompt, t.answer, t.answer, (q.expression,)
    messages = ({"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                {"role": "user", "content": q2}, {"role": "assistant", "content": a2})
    return Conversation(kind, lang, messages, answer, exprs)


# ---------------------------------------------------------------------------
# Requests outside the model's skills, answered with what it can do

SCOPE_ANSWER = {
    "en": ("I can solve arithmetic word problems and do simple text tasks such as reversing, repeating or"
           " capitalizing words, sorting numbers, finding the largest number, counting words or giving the last"
           " word of a list. I cannot help with this request."),
    "zh": "我会解算术应用题，也会做一些简单的文字任务，比如倒写、重复单词、排序数字、找出最大的数或数单词。这个请求我帮不上忙。",
}
# The same statement where SFT also learns to continue a passage of verse (prepare.continuation_train
# above 0): the list of skills says so, and nothing else changes.
SCOPE_ANSWER_VERSE = {
    "en": ("I can solve arithmetic word problems, continue a passage of verse you give me, and do simple text tasks"
           " such as reversing, repeating or capitalizing words, sorting numbers, finding the largest number,"
           " counting words or giving the last word of a list. I cannot help with this request."),
    "zh": "我会解算术应用题，会续写你给的一段诗句，也会做一些简单的文字任务，比如倒写、重复单词、排序数字、找出最大的数或数单词。"
          "这个请求我帮不上忙。",
}
_TOPICS = ["the sea", "the moon", "autumn", "a lost dog", "friendship", "the city at night", "mountains", "rain",
           "an old clock", "the stars", "a small village", "winter mornings", "the desert", "a train journey",
           "birds", "the forest", "summer holidays", "a lighthouse", "coffee", "the river", "robots", "music",
           "a birthday", "the wind", "gardens"]
_FORMS = ["poem", "story", "song", "haiku", "letter", "speech", "short essay", "limerick"]
_PEOPLE = ["Napoleon", "Marie Curie", "Albert Einstein", "Cleopatra", "Leonardo da Vinci", "Confucius", "Ada Lovelace",
           "Isaac Newton", "Frida Kahlo", "Nelson Mandela", "Julius Caesar", "Charles Darwin", "Mozart",
           "Queen Victoria", "Galileo", "Joan of Arc", "Abraham Lincoln", "Genghis Khan", "Jane Austen",
           "Nikola Tesla"]
_OPINIONS = ["modern art", "social media", "electric cars", "homework", "city life", "video games", "pineapple on"
             " pizza", "remote work", "space travel", "reality television", "cats", "the four-day week",
             "classical music", "fast food", "online shopping"]
_PHRASES = ["good morning", "where is the station", "thank you very much", "I love books", "see you tomorrow",
            "the weather is nice", "how much does it cost", "happy birthday"]
_LANGUAGES = ["French", "German", "Spanish", "Japanese", "Italian", "Russian"]
_COUNTRIES = ["France", "Brazil", "Kenya", "Canada", "Japan", "Egypt", "Peru", "Norway", "India", "Australia",
              "Mexico", "Vietnam", "Ghana", "Chile", "Poland"]
_THINGS = ["a rainbow", "the internet", "a vaccine", "an airplane engine", "the stock market", "a refrigerator",
           "photosynthesis", "a black hole", "democracy", "a bicycle gear", "the heart", "an election"]
_SCOPE_EN = [
    ("Write a {form} about {topic}.", ("form", "topic")),
    ("Who was {person}?", ("person",)),
    ("Tell me about the life of {person}.", ("person",)),
    ("What do you think about {opinion}?", ("opinion",)),
    ("Is {opinion} a good idea?", ("opinion",)),
    ("Translate \"{phrase}\" into {language}.", ("phrase", "language")),
    ("What is the capital of {country}?", ("country",)),
    ("Plan a trip to {country} for me.", ("country",)),
    ("Explain how {thing} works.", ("thing",)),
    ("Tell me a joke about {topic}.", ("topic",)),
    ("Give me a title for a book about {topic}.", ("topic",)),
]
_FILL = {"form": _FORMS, "topic": _TOPICS, "person": _PEOPLE, "opinion": _OPINIONS, "phrase": _PHRASES,
         "language": _LANGUAGES, "country": _COUNTRIES, "thing": _THINGS}
_ZH_TOPICS = ["大海", "月亮", "秋天", "春雨", "故乡", "星空", "长城", "梅花", "冬天的早晨", "小狗", "友谊", "高山",
              "森林", "沙漠", "火车旅行", "灯塔", "咖啡", "河流", "机器人", "音乐", "生日", "风", "花园", "老钟"]
_ZH_PEOPLE = ["李白", "孔子", "秦始皇", "爱因斯坦", "居里夫人", "拿破仑", "鲁迅", "牛顿", "杜甫", "达尔文", "莫扎特",
              "诸葛亮", "武则天", "伽利略", "苏轼", "孙中山"]
_ZH_OPINIONS = ["网上购物", "电动汽车", "短视频", "在家上班", "现代艺术", "电子游戏", "快餐", "太空旅行", "养猫",
                "城市生活", "古典音乐", "社交媒体"]
_ZH_PHRASES = ["早上好", "谢谢你", "我喜欢看书", "明天见", "今天天气很好", "生日快乐", "车站在哪里", "这个多少钱",
               "我很高兴", "晚安"]
_ZH_COUNTRIES = ["法国", "巴西", "日本", "埃及", "加拿大", "印度", "肯尼亚", "秘鲁", "挪威", "澳大利亚", "墨西哥", "越南"]
_ZH_THINGS = ["彩虹", "互联网", "疫苗", "飞机发动机", "股市", "冰箱", "光合作用", "黑洞", "自行车变速器", "心脏"]
# Chinese requests: enough distinct ones (216) that the Chinese share of scope_train teaches the
# statement from about as many examples per word as the English one gets.
_SCOPE_ZH = [("写一首关于{t}的诗。", _ZH_TOPICS),
             ("写一个关于{t}的故事。", _ZH_TOPICS),
             ("讲一个关于{t}的笑话。", _ZH_TOPICS),
             ("给一本关于{t}的书起个名字。", _ZH_TOPICS),
             ("{t}是谁？", _ZH_PEOPLE),
             ("给我讲讲{t}的生平。", _ZH_PEOPLE),
             ("你觉得{t}怎么样？", _ZH_OPINIONS),
             ("{t}是个好主意吗？", _ZH_OPINIONS),
             ("把“{t}”翻译成英文。", _ZH_PHRASES),
             ("把“{t}”翻译成日文。", _ZH_PHRASES),
             ("{t}的首都是哪里？", _ZH_COUNTRIES),
             ("帮我计划一次去{t}的旅行。", _ZH_COUNTRIES),
             ("解释一下{t}是怎么工作的。", _ZH_THINGS),
             ("{t}的原理是什么？", _ZH_THINGS)]


@dataclass(frozen=True)
class ScopeRequest:
    prompt: str
    answer: str   # SCOPE_ANSWER in the prompt's language
    lang: str


def scope_prompt_count(lang: str) -> int:
    """How many distinct requests `scope_request` can make in `lang`."""
    if lang == "en":
        return sum(math.prod(len(_FILL[s]) for s in slots) for _, slots in _SCOPE_EN)
    return sum(len(fills) for _, fills in _SCOPE_ZH)


def scope_request(rng: random.Random, lang: str = "en", verse: bool = False) -> ScopeRequest:
    """A general request that no generator here answers (a poem, a question about a person, an
    opinion, a translation, a capital...), with the answer taught for all of them: what the
    model can do, in the request's language (`SCOPE_ANSWER`, or `SCOPE_ANSWER_VERSE` with
    `verse`: where it also learns to continue verse). `verse` draws nothing: the same rng gives
    the same requests either way."""
    if lang == "en":
        template, slots = rng.choice(_SCOPE_EN)
        prompt = template.format(**{s: rng.choice(_FILL[s]) for s in slots})
    else:
        template, fills = rng.choice(_SCOPE_ZH)
        prompt = template.format(t=rng.choice(fills))
    return ScopeRequest(prompt, (SCOPE_ANSWER_VERSE if verse else SCOPE_ANSWER)[lang], lang)


# ---------------------------------------------------------------------------
# Math asked in the contexts a chat brings: after another request, under a system message

# System messages a client sends: the short ones people type and what most chat clients send by
# default. A Chinese question is asked under the English ones as often as under the Chinese ones
# (a client's default is English whatever the user writes). The evaluation also asks under a
# message that is not here, to see whether the answer holds for one never trained on.
SYSTEM_MESSAGES = {
    "en": ("You are terse.", "You are a helpful assistant.", "Be concise.", "You are a helpful assistant. Answer"
           " briefly.", "You are a friendly math tutor.", "Answer the user's questions.", "You are an AI assistant.",
           "Reply in plain text.", "You are a patient teacher.", "Keep your answers short."),
    "zh": ("请简洁回答。", "你是一个乐于助人的助手。", "你是一位数学老师。", "回答要简短。", "你是一个AI助手。",
           "请用中文回答。"),
}
CONTEXT_OPENINGS = ("scope", "task", "none")


@dataclass(frozen=True)
class ContextConversation:
    opening: str                   # one of CONTEXT_OPENINGS: the exchange before the question
    system: str                    # the system message, "" for none
    lang: str                      # the question's language ("en" | "zh")
    messages: tuple[dict, ...]     # [system,] [user, assistant,] user, assistant
    question: str                  # the math question asked last
    expression: str                # its bare calculation ("7 + 5"), "" for a word problem
    opening_prompt: str            # the user turn of the opening exchange, "" for none


def context_conversation(rng: random.Random, lang: str = "en", opening: str | None = None,
                         system_share: float = 0.5, levels: tuple[int, ...] = (1, 2, 3, 4),
                         verse: bool = False) -> ContextConversation:
    """A math question (a bare calculation half the time, else a word problem at one of
    `levels`) answered as it is alone, asked after an opening exchange (a random one of
    `CONTEXT_OPENINGS` unless given):

    - scope: an out-of-scope request in the question's language, answered with `SCOPE_ANSWER`
      (`SCOPE_ANSWER_VERSE` with `verse`; the model must not keep answering with the statement once
      a question is in its skills);
    - task: an instruction task (English: the tasks are), answered;
    - none: no exchange before the question.

    Under a system message (`SYSTEM_MESSAGES`) with probability `system_share`, and always when
    `opening` is none (without one that would be a plain question)."""
    if opening is None:
        opening = rng.choice(CONTEXT_OPENINGS)
    elif opening not in CONTEXT_OPENINGS:
        raise ValueError(f"context_conversation: unknown opening {opening!r}; expected one of"
                         f" {', '.join(CONTEXT_OPENINGS)}")
    system = ""
    if opening == "none" or rng.random() < system_share:
        system = rng.choice(SYSTEM_MESSAGES["zh" if lang == "zh" and rng.random() < 0.5 else "en"])
    before: tuple[dict, ...] = ()
    if opening == "scope":
        r = scope_request(rng, lang, verse=verse)
        before = ({"role": "user", "content": r.prompt}, {"role": "assistant", "content": r.answer})
    elif opening == "task":
        t = task(rng)
        before = ({"role": "user", "content": t.prompt}, {"role": "assistant", "content": t.answer})
    q, a, _, expr = _first_turn(rng, lang, list(levels))
    messages = (*([{"role": "system", "content": system}] if system else []), *before,
                {"role": "user", "content": q}, {"role": "assistant", "content": a})
    return ContextConversation(opening, system, lang, messages, q, expr, before[0]["content"] if before else "")
