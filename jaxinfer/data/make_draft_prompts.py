"""Writes draft_prompts.jsonl: the chat prompts EAGLE draft heads are trained on (by
self-distillation) and held out on. Medusa's 10 task templates and 32 training topics
(``make_medusa_prompts``) plus 20 more shapes of chat request and 8 more topics, so the head
learns answers rather than ten templates. Deterministic (fixed seed); the held-out prompts (96)
use only the 8 held-out topics, which no training prompt mentions.

    python jaxinfer/data/make_draft_prompts.py
"""

from make_medusa_prompts import TASKS as MEDUSA_TASKS
from make_medusa_prompts import TOPICS as MEDUSA_TOPICS
from make_medusa_prompts import write_prompt_set

TASKS = MEDUSA_TASKS + [
    "I want to learn about {t}. Where should I start?", "Write a friendly email inviting a colleague to a talk on {t}.",
    "What are some common misconceptions about {t}?", "Give me five tips related to {t}.",
    "Can you write a haiku about {t}?", "Why is {t} important?", "Describe {t} in one paragraph.",
    "What would a world without {t} look like?", "Write a dialogue between two friends discussing {t}.",
    "List the main steps involved in understanding {t}.", "Tell me a fun fact about {t} and explain it.",
    "How has {t} changed over the last hundred years?", "Write a short speech about {t} for a school assembly.",
    "Compare {t} with something similar and explain the differences.", "What careers are connected to {t}?",
    "Write a limerick about {t}.", "Give a beginner's guide to {t} in bullet points.",
    "What is the most surprising thing about {t}?", "Write a diary entry from someone who loves {t}.",
    "How can a family enjoy {t} together on a weekend?",
]
HELD_TOPICS = MEDUSA_TOPICS[-8:]
TRAIN_TOPICS = MEDUSA_TOPICS[:-8] + ["friendship", "cooking rice", "the ocean", "music lessons", "robots", "museums",
                                     "camping", "pizza"]


def main() -> None:
    write_prompt_set("draft_prompts.jsonl", TASKS, TRAIN_TOPICS, HELD_TOPICS, 96)


if __name__ == "__main__":
    main()
