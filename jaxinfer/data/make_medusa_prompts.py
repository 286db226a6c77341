"""Writes medusa_prompts.jsonl: the chat prompts Medusa heads are trained on (by self-distillation)
and held out on. Deterministic: tasks x topics, shuffled with a fixed seed; the last 20% are the
held-out set (``"split": "heldout"``), whose topics the training prompts never mention.

    python jaxinfer/data/make_medusa_prompts.py
"""

import json
import random
from pathlib import Path

TASKS = [
    "Explain {t} to a ten-year-old.", "Write a short poem about {t}.", "Give three interesting facts about {t}.",
    "What are the pros and cons of {t}?", "Write a short story that involves {t}.",
    "Summarize the history of {t} in a few sentences.", "How would you teach someone about {t}?",
    "Write a product description for something related to {t}.", "What questions do people often ask about {t}?",
    "Describe a typical day for someone who works with {t}.",
]
TOPICS = [
    "volcanoes", "the water cycle", "honeybees", "electric cars", "the Roman Empire", "photosynthesis",
    "chess", "black holes", "coffee", "the internet", "rainforests", "jazz music", "the moon landing",
    "recycling", "dinosaurs", "the human heart", "origami", "solar panels", "the Olympic Games", "penguins",
    "bread baking", "earthquakes", "the printing press", "vaccines", "mountain climbing", "the stock market",
    "sharks", "video games", "gardening", "the Great Wall of China", "bicycles", "clouds",
    # held-out topics (only in the last 8)
    "lighthouses", "glaciers", "board games", "octopuses", "trains", "tea ceremonies", "kites", "deserts",
]


def write_splits(name: str, train: list[str], held: list[str]) -> Path:
    """The JSONL ``train_medusa.load_prompts`` reads: training prompts, then held-out ones,
    each line {"prompt", "split"}, written beside this script."""
    rows = [{"prompt": p, "split": "train"} for p in train] + [{"prompt": p, "split": "heldout"} for p in held]
    out = Path(__file__).with_name(name)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def write_prompt_set(name: str, tasks, train_topics, held_topics, num_held: int) -> None:
    """tasks x topics, each split shuffled with a fixed seed, the first num_held held out."""
    rng = random.Random(0)
    train = [task.format(t=t) for t in train_topics for task in tasks]
    held = [task.format(t=t) for t in held_topics for task in tasks]
    rng.shuffle(train)
    rng.shuffle(held)
    held = held[:num_held]
    print(f"{write_splits(name, train, held)}: {len(train)} training prompts, {len(held)} held out")


def main() -> None:
    write_prompt_set("medusa_prompts.jsonl", TASKS, TOPICS[:-8], TOPICS[-8:], 64)


if __name__ == "__main__":
    main()
