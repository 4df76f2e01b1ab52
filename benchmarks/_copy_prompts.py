"""Copy-heavy chat prompts (quote, edit, summarise with quotes, edit code) for the
speculative decoding benchmark: answers that repeat long stretches of the prompt."""

from __future__ import annotations

PASSAGES = [
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers "
    "climbed the same one hundred and twelve steps every evening to light the lamp. The last keeper, "
    "a quiet man named Elias Brand, kept a logbook in which he wrote the weather, the ships that "
    "passed and the birds that rested on the gallery rail. When the light was automated in 1987, he "
    "left the logbook on the table by the window, open at a blank page.",
    "Bread is made from four simple ingredients: flour, water, salt and yeast. The yeast eats the "
    "sugars in the flour and releases carbon dioxide, which is trapped by a stretchy network of "
    "gluten proteins. Kneading strengthens that network, and a long, cool rise gives the dough time "
    "to develop flavour. Baking at a high temperature sets the structure and browns the crust.",
    "A compiler translates a program written in a high-level language into machine code. It first "
    "reads the source text and splits it into tokens, then builds a syntax tree that captures the "
    "structure of the program. Later stages check types, optimise the code and finally emit "
    "instructions for a specific processor. Good error messages are one of the hardest parts to get right.",
    "The river rises in the northern hills as a handful of cold springs. It gathers speed through a "
    "steep valley of pine forest, slows as it reaches the farmland of the plain, and finally spreads "
    "into a wide, muddy delta where thousands of wading birds spend the winter. Three towns grew up "
    "along its banks, each at a place where the water could be crossed.",
    "Our team meeting is moved from Tuesday to Thursday at 10 a.m. in room 4B. Please bring your "
    "updated project plans and a short list of the risks you see for the next quarter. Sarah will "
    "present the new budget, and Tom will give an update on the hiring process. The meeting should "
    "last about one hour, and lunch will be provided afterwards in the kitchen.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the "
    "leaf, chlorophyll absorbs sunlight and uses its energy to split water molecules, releasing "
    "oxygen. The plant then combines carbon dioxide from the air with the stored energy to build "
    "sugars, which feed its growth and are the base of almost every food chain on Earth.",
]

TYPOS = {
    "the": "teh",
    "and": "adn",
    "which": "wich",
    "their": "thier",
    "receive": "recieve",
    "water": "watter",
    "process": "proccess",
    "meeting": "meting",
    "program": "progam",
}

CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef total(values):\n    result = 0\n    for v in values:\n"
    "        result = add(result, v)\n    return result\n\n\nprint(total([1, 2, 3, 4]))\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n        return self.count\n\n    def reset(self):\n        self.count = 0\n",
]


def _typo(text: str) -> str:
    return " ".join(TYPOS.get(w, w) for w in text.split(" "))


def copy_heavy_messages(n: int) -> list[list[dict]]:
    """`n` single-turn chats, cycling through the tasks and the passages."""
    tasks = [
        lambda p: f"Repeat the following text exactly, word for word:\n\n{p}",
        lambda p: (
            f"Fix the spelling mistakes in the following text and write out the whole corrected text:\n\n{_typo(p)}"
        ),
        lambda p: f"Summarise the following text, quoting its key sentences exactly in quotation marks:\n\n{p}",
        lambda p: f"Copy this text and add a title to it:\n\n{p}",
    ]
    out = []
    for i in range(n):
        if i % 5 == 4:
            code = CODE[(i // 5) % len(CODE)]
            content = f"Add a docstring to each function in this Python code and print the whole code:\n\n{code}"
        else:
            content = tasks[i % len(tasks)](PASSAGES[(i // len(tasks)) % len(PASSAGES)])
        out.append([{"role": "user", "content": content}])
    return out
