"""The project's own self-distillation prompts: request templates crossed with topic lists.

Written for medusa-heads and kept apart from the benchmark prompts (`make_prompt_set` drops any prompt
that shares a 4-word sequence with a prompt of the file given as `exclude`). Run as a script to rebuild
`training/data/distill_prompts.jsonl`:

    python -m medusa_heads.training.prompt_set --exclude benchmarks/prompts.jsonl
"""

import argparse
import json
import random
import re
from pathlib import Path

SHIPPED = Path(__file__).parent / "data" / "distill_prompts.jsonl"

EVERYDAY = """gardening on a balcony|saving money on groceries|training a puppy|learning a second language|running a first
marathon|keeping houseplants alive|cycling to work|planning a camping trip|baking sourdough bread|decluttering a small
apartment|starting a book club|brewing coffee at home|caring for an elderly cat|fixing a flat bicycle tyre|hosting a dinner
party|moving to a new city|working from home|learning to swim as an adult|building a birdhouse|making friends after
university|visiting a farmers market|composting kitchen scraps|choosing a first car|packing for a long flight|teaching a
child to ride a bike|writing a daily journal|volunteering at an animal shelter|organising a garage sale|picking a
laptop for school|sleeping better|drinking more water|cooking for one person|planning a wedding on a budget|painting a
bedroom|adopting a rescue dog|learning the guitar|keeping a sourdough starter|preparing for a job interview|repairing a
wooden chair|renting a first flat|growing tomatoes|making candles|meal prepping for the week|taking better phone
photos|knitting a scarf|birdwatching in winter|staying focused while studying|walking in the mountains|recycling
electronics|reducing screen time""".replace("\n", " ").split("|")

SCIENCE = """black holes|the immune system|plate tectonics|volcanoes|the theory of evolution|DNA replication|climate
change|ocean tides|the speed of light|electric circuits|magnets|the periodic table|chemical bonds|the human heart|the
nervous system|vaccines|antibiotics|solar panels|wind turbines|nuclear fission|the greenhouse effect|earthquakes|the
moon's phases|comets|the Milky Way|gravity|friction|sound waves|lightning|clouds|coral reefs|bees and pollination|the
carbon cycle|batteries|semiconductors|the internet|GPS satellites|3D printing|machine learning|encryption|the
microscope|cell division|enzymes|the digestive system|photosynthesis in algae|rain forests|deserts|glaciers|the
ozone layer|radioactivity|telescopes|the Big Bang|exoplanets|tsunamis|hurricanes|the water table|soil erosion|
fermentation|blood types|the human eye""".replace("\n", " ").split("|")

HISTORY = """the Roman Empire|ancient Egypt|the Industrial Revolution|the Renaissance|the Cold War|the invention of the
telephone|the Ming dynasty|the Aztec Empire|the Magna Carta|the American Revolution|the fall of the Berlin Wall|the
Ottoman Empire|the Vikings|the Meiji Restoration|the Great Depression|the space race|the abolition of slavery|the
printing of the first newspapers|ancient Greek democracy|the Mongol Empire|the Inca road system|the Hanseatic
League|the Enlightenment|impressionist painting|Baroque music|Shakespeare's theatre|the history of jazz|the
women's suffrage movement|the Protestant Reformation|the Black Death|the Byzantine Empire|the Mughal Empire|the
Maya calendar|the Phoenicians|the construction of the pyramids|the Great Wall of China|the partition of India|the
history of the bicycle|the spread of coffee|the history of chess|existentialism|stoicism|utilitarianism|the social
contract|Confucianism|Buddhist philosophy|the history of writing|the invention of money|the history of
vaccines|the origins of the Olympic Games""".replace("\n", " ").split("|")

CODE_TASKS = """checks whether a word is a palindrome|finds the largest number in a list|counts the vowels in a
string|merges two sorted lists|removes whitespace from both ends of a string|computes the factorial of a number|checks
whether a number is prime|converts Celsius to Fahrenheit|flattens a nested list|finds the most common element in a
list|reads a CSV file and prints each row|sorts a list of dictionaries by a key|computes the greatest common
divisor of two numbers|generates a random password|checks whether two strings are anagrams|returns the second
largest number in a list|capitalises every word in a sentence|computes the sum of the digits of a number|validates
an email address with a regular expression|implements binary search|implements bubble sort|counts lines in a
text|returns the unique characters of a string|transposes a matrix|checks whether brackets are balanced|converts a
number to binary|computes a running average|groups words by their first letter|finds all pairs that sum to a
target|removes every other element from a list|parses a date string|chunks a list into pieces of size n|rotates a
list by k positions|computes the mean and median of a list|converts a dictionary to JSON|reverses the words in a
sentence|counts word frequencies in a paragraph|implements a simple stack class|implements a queue with two
stacks|finds the longest word in a sentence""".replace("\n", " ").split("|")

LANGUAGES = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "Ruby", "C++", "Bash"]

PERSONAS = """a museum guide|a pirate captain|a detective in 1920s London|a kindergarten teacher|a medieval
blacksmith|a space station commander|a wise old wizard|a football coach at half time|a travel agent|a park
ranger|a barista|a bookshop owner|a robot learning about humans|a nutritionist|a history professor|a news
reporter|a yoga instructor|a mountain guide|a zookeeper|a tech support agent|a wedding planner|a movie
director|a chess grandmaster|a marine biologist|a startup founder|a lighthouse keeper|a jazz musician|a
gardener|an astronaut|a librarian in a haunted library""".replace("\n", " ").split("|")

NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lucas", "Fatima", "Olga", "Pedro", "Chen", "Grace", "Ravi", "Emma",
         "Noah", "Sofia", "Ibrahim", "Lena", "Mateo", "Hana", "Jonas", "Priya"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Seoul", "Dublin", "Hanoi", "Denver",
          "Krakow", "Perth", "Quito", "Accra"]

TEMPLATES = {
    "writing": [
        "Write a short essay about {e}.", "Write a blog post with practical tips on {e}.",
        "Write a poem about {s}.", "Write a short story in which someone gets into {e}.",
        "Write a persuasive paragraph encouraging people to try {e}.", "Write a limerick about {s}.",
        "Write a newsletter introduction about {e}.", "Write a motivational message for someone who is {e}.",
        "Write a friendly letter to a friend describing your week of {e}.",
        "Write a product review of a book about {h}.", "Write a short speech about {h}.",
    ],
    "roleplay": [
        "You are {p}. Introduce yourself and describe a typical day.",
        "Imagine you are {p}. Give advice to a beginner interested in {e}.",
        "Act as {p} and explain {s} to a curious visitor.", "Pretend to be {p} and tell a short anecdote.",
        "You are {p}. A customer is upset. Calm them down.", "Role-play as {p} answering questions about {h}.",
    ],
    "reasoning": [
        "What are the pros and cons of {e}?", "Compare two approaches to {e} and say which you prefer.",
        "What could go wrong when {e}, and how can it be avoided?", "Give three arguments for and against {e}.",
        "Explain the cause and effect relationships behind {s}.", "Why might someone disagree about {h}?",
    ],
    "stem": [
        "Explain {s} to a ten-year-old.", "What is the science behind {s}?", "Give five facts about {s}.",
        "Describe how scientists study {s}.", "What are common misconceptions about {s}?",
        "Summarize what we know about {s} in a few paragraphs.", "How does {s} affect everyday life?",
    ],
    "humanities": [
        "Give an overview of {h}.", "What were the main consequences of {h}?", "Who were the key figures of {h}?",
        "Explain why {h} still matters today.", "Write a short timeline of {h}.",
        "What can we learn from {h}?", "Describe daily life during {h}.",
    ],
    "coding": [
        "Write a {l} function that {c}.", "Explain step by step how to write a program in {l} that {c}.",
        "Write a {l} function that {c}, and add comments.", "Show a {l} example that {c} and explain its complexity.",
    ],
}


def _math_prompts(rng: random.Random, n: int) -> list[str]:
    makers = [
        lambda: f"Solve for x: {rng.randint(2, 12)}x - {rng.randint(1, 40)} = {rng.randint(10, 90)}. Show your work.",
        lambda: f"What is {rng.randint(5, 95)} percent of {rng.randint(20, 900)}? Explain.",
        lambda: f"A train travels {rng.randint(40, 400)} kilometres in {rng.randint(2, 7)} hours. What is its average speed?",
        lambda: f"Calculate the perimeter and area of a rectangle that is {rng.randint(2, 30)} m by {rng.randint(2, 30)} m.",
        lambda: f"What is {rng.randint(12, 999)} multiplied by {rng.randint(3, 99)}? Explain the method.",
        lambda: f"Simplify the fraction {rng.randint(2, 60)}/{rng.randint(61, 180)} and explain each step.",
        lambda: f"{rng.choice(NAMES)} buys {rng.randint(2, 9)} notebooks at {rng.randint(2, 15)} dollars each and pays with a "
                f"{rng.choice([50, 100])} dollar bill. How much change is left?",
        lambda: f"Find the volume of a cube with sides of {rng.randint(2, 25)} centimetres.",
        lambda: f"What is the square root of {rng.randint(2, 40) ** 2}, and how can you check it?",
        lambda: f"Explain how to find the least common multiple of {rng.randint(2, 20)} and {rng.randint(21, 60)}.",
    ]
    return [rng.choice(makers)() for _ in range(n)]


def _extraction_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        people = rng.sample(NAMES, 3)
        cities = rng.sample(CITIES, 3)
        facts = ", ".join(f"{p} lives in {c} and is {rng.randint(19, 80)}" for p, c in zip(people, cities))
        kind = rng.choice(["List each person with their city as JSON", "Who is the oldest person", "Make a table of the people",
                           "Extract every city mentioned", "Summarize in one sentence"])
        out.append(f"{kind}: {facts}.")
    return out


def shingles(text: str, n: int = 4) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def make_prompt_set(seed: int = 0, exclude: Path | None = None) -> list[dict]:
    rng = random.Random(seed)
    prompts = []
    for category, templates in TEMPLATES.items():
        for template in templates:
            for _ in range(120):
                prompts.append((category, template.format(
                    e=rng.choice(EVERYDAY), s=rng.choice(SCIENCE), h=rng.choice(HISTORY),
                    p=rng.choice(PERSONAS), c=rng.choice(CODE_TASKS), l=rng.choice(LANGUAGES))))
    prompts += [("math", p) for p in _math_prompts(rng, 1500)]
    prompts += [("extraction", p) for p in _extraction_prompts(rng, 1000)]
    banned = set()
    if exclude is not None:
        for line in Path(exclude).read_text().splitlines():
            if line.strip():
                banned |= shingles(json.loads(line)["prompt"])
    seen, rows = set(), []
    for category, prompt in prompts:
        if prompt in seen or shingles(prompt) & banned:
            continue
        seen.add(prompt)
        rows.append({"id": f"{category}-{len(rows)}", "category": category, "prompt": prompt})
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exclude", type=Path, help="benchmark prompts (jsonl) that must stay out of the set")
    parser.add_argument("--out", type=Path, default=SHIPPED)
    args = parser.parse_args()
    rows = make_prompt_set(exclude=args.exclude)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")
