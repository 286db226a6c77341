"""Writes draft_prompts.jsonl: the chat prompts EAGLE draft heads are trained on (by
self-distillation) and held out on. Deterministic (fixed seed).

Two halves, so the head learns answers rather than a few templates:

* **kinds x topics**: Medusa's 10 task templates and 20 more shapes of request about a topic
  (``make_medusa_prompts``), 40 training topics; 600 of the 1,200 pairs are drawn.
* **general chat**: 13 families of everyday request (stories, recipes, tips, explanations,
  how-to, emails, comparisons, definitions, suggestions, plans, small programs, advice, opinions),
  each a few phrasings over its own fillers; 600 prompts are drawn.

The 96 held-out prompts are half of each kind, built only from held-out topics and fillers,
which no training prompt mentions. None of the prompts is one of ``benchmarks/spec_decode.py``'s
chat prompts or about their subjects (robots, painting, working from home, rainbows, pasta).

    python jaxinfer/data/make_draft_prompts.py
"""

import random

from make_medusa_prompts import TASKS as MEDUSA_TASKS
from make_medusa_prompts import TOPICS as MEDUSA_TOPICS
from make_medusa_prompts import write_splits

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
TRAIN_TOPICS = MEDUSA_TOPICS[:-8] + ["friendship", "cooking rice", "the ocean", "music lessons", "libraries", "museums",
                                     "camping", "pizza"]

# family: (phrasings, training fillers, held-out fillers)
CHAT = {
    "story": (["Write a short story about {x}.", "Tell me a bedtime story about {x}.",
               "Write a story for children about {x}.", "Can you write a funny story about {x}?"],
              ["a cat who wants to fly", "a girl who finds a magic key", "an old fisherman and a talking fish",
               "a boy who builds a rocket", "a dragon who is afraid of the dark", "two friends lost in a forest",
               "a detective who solves a mystery at school", "a baker who makes a giant cake",
               "a dog who becomes the town mayor", "a knight who cannot ride a horse", "a snowman who wants summer",
               "an astronaut who meets a friendly alien", "a mouse who lives in a library",
               "a grandmother who wins a race", "a tree that can walk", "a pirate who hates the sea",
               "a shy student on the first day of school", "a wizard who loses his wand",
               "a family moving to a new city", "a little cloud that wants to rain"],
              ["a turtle who wants to be fast", "a princess who becomes a scientist", "a clock that stops time",
               "a musician who loses her voice"]),
    "recipe": (["Give me a recipe for {x}.", "How do I make {x} at home?", "What is a simple way to cook {x}?",
                "Write step-by-step instructions for making {x}."],
               ["pancakes", "chicken soup", "a chocolate cake", "fried rice", "guacamole", "banana bread",
                "a Greek salad", "tomato soup", "scrambled eggs", "homemade pizza dough", "lemonade",
                "vegetable curry", "oatmeal cookies", "a fruit smoothie", "garlic bread", "beef stew",
                "apple pie", "hummus", "French toast", "a tuna sandwich"],
               ["mushroom risotto", "lentil soup", "blueberry muffins", "a stir-fried tofu dish"]),
    "tips": (["What are three tips for {x}?", "How can I get better at {x}?", "Give me some advice on {x}.",
              "What are the best ways of {x}?"],
             ["sleeping better", "saving money", "learning a new language", "staying healthy in winter",
              "making new friends", "studying for exams", "running a first marathon", "keeping a plant alive",
              "reducing stress", "speaking in public", "writing a good essay", "organizing a small apartment",
              "eating more vegetables", "getting up early", "preparing for a job interview",
              "traveling on a budget", "taking better photos", "remembering names", "drinking more water",
              "keeping a journal"],
             ["learning to swim as an adult", "spending less time on the phone", "moving to a new country",
              "caring for an old dog"]),
    "explain": (["Explain how {x}, in simple words.", "Why is it that {x}?", "Can you explain how {x}?",
                 "Describe the science behind how {x}."],
                ["a plane stays in the air", "the seasons change", "a refrigerator keeps food cold",
                 "the heart pumps blood", "plants grow from seeds", "thunder happens", "a battery stores energy",
                 "the tides work", "a compass points north", "ice floats on water", "we hear sounds",
                 "soap cleans our hands", "a microwave heats food", "the moon changes shape",
                 "bread rises", "a camera takes a picture", "wind is made", "our eyes see colours",
                 "a bicycle stays upright", "the internet sends messages"],
                ["a rocket reaches space", "leaves change colour in autumn", "a submarine dives",
                 "fireflies glow"]),
    "howto": (["How do I {x}?", "Teach me how to {x}, step by step.", "What is the easiest way to {x}?"],
              ["tie a tie", "change a flat tire", "plant tomatoes", "start a blog", "learn to juggle",
               "make a paper airplane", "set up a fish tank", "knit a scarf", "write a resume",
               "train a puppy", "build a birdhouse", "hang a shelf", "start running", "meditate",
               "back up my computer", "fold a fitted sheet", "make a budget", "play the guitar",
               "clean a laptop keyboard", "grow herbs indoors"],
              ["brew a cup of tea properly", "fix a leaking tap", "learn chess openings", "sew on a button"]),
    "email": (["Write an email to {x}.", "Help me write a short message to {x}.", "Draft a polite note to {x}."],
              ["my landlord about a broken heater", "my teacher asking for more time on homework",
               "a friend I have not seen in years", "my manager asking for a day off",
               "a neighbour about a noisy party", "a company about a late delivery",
               "my team thanking them for their hard work", "a hotel asking about breakfast times",
               "my grandmother for her birthday", "a client about a delayed project",
               "a new colleague welcoming them", "a restaurant about a reservation",
               "my coach saying I will miss practice", "a shop asking for a refund",
               "the school about a field trip", "a doctor's office to move an appointment"],
              ["a library about a lost book", "my sister congratulating her on a new job",
               "a plumber asking for a quote", "a club asking to join"]),
    "compare": (["What is the difference between {x}?", "Compare {x}.", "Which is better for a beginner: {x}?"],
                ["cats and dogs as pets", "tea and coffee", "a laptop and a tablet", "weather and climate",
                 "a virus and bacteria", "renting and buying a home", "the sun and other stars",
                 "baking and frying", "a lake and a sea", "trains and planes for travel",
                 "fiction and non-fiction", "a crocodile and an alligator", "walking and cycling to work",
                 "paper books and e-books", "a city and a village", "a violin and a cello"],
                ["a frog and a toad", "skiing and snowboarding", "a moth and a butterfly",
                 "printed maps and GPS"]),
    "define": (["What does {x} mean?", "Define {x} and give an example.", "What is {x}?"],
               ["inflation", "democracy", "gravity", "a metaphor", "photosynthesis in one sentence",
                "an ecosystem", "a budget", "empathy", "a noun", "renewable energy", "a habit",
                "a prime number", "a fossil", "an algorithm", "a fable", "friction"],
               ["an idiom", "erosion", "a symphony", "a haiku"]),
    "suggest": (["Suggest five {x}.", "Can you recommend some {x}?", "Give me a list of {x}."],
                ["names for a new puppy", "games to play at a birthday party", "books for a long flight",
                 "healthy snacks for work", "things to do on a rainy day", "gifts for a ten-year-old",
                 "hobbies to try this year", "questions to ask on a first date", "songs for a road trip",
                 "ideas for a school science project", "ways to celebrate a friend's birthday",
                 "board games for two people", "fun facts to share at dinner", "outdoor activities for kids",
                 "names for a bakery", "easy houseplants"],
                ["themes for a costume party", "podcasts about history", "warm-up exercises before sport",
                 "titles for a mystery novel"]),
    "plan": (["Plan {x}.", "Help me plan {x}.", "Make a simple schedule for {x}."],
             ["a three-day trip to Paris", "a picnic in the park", "a week of healthy dinners",
              "a surprise party for my mother", "a study week before exams", "a weekend camping trip",
              "a day at the beach with children", "a small wedding", "a morning routine",
              "a garden for the spring", "a reading challenge for a month", "a family movie night",
              "a road trip along the coast", "a first week at a new job", "a bake sale for the school",
              "a ten-minute workout"],
             ["a visit to a zoo", "a two-day trip to Rome", "a charity run", "a cleaning day at home"]),
    "code": (["Write a Python function that {x}.", "Show me how to write code that {x}.",
              "Write a short program that {x} and explain it."],
             ["reverses a string", "checks whether a number is prime", "counts the words in a sentence",
              "finds the largest number in a list", "converts Celsius to Fahrenheit",
              "sorts a list of names", "returns the factorial of a number", "removes duplicates from a list",
              "checks whether a word is a palindrome", "adds up the even numbers in a list",
              "prints a multiplication table", "counts the vowels in a text", "finds the average of a list",
              "merges two dictionaries", "reads a file and prints its lines", "generates a random password"],
             ["computes the Fibonacci numbers", "capitalizes every word in a sentence",
              "finds the second smallest number in a list", "counts how often each letter appears"]),
    "advice": (["I feel {x}. What should I do?", "My friend feels {x}. How can I help?",
                "What can someone do when they feel {x}?"],
               ["nervous before a test", "lonely after moving", "tired all the time", "bored at work",
                "overwhelmed by chores", "worried about money", "stuck on a hard problem",
                "unmotivated to exercise", "homesick at university", "angry after an argument",
                "afraid of flying", "jealous of a friend", "distracted when studying", "sad on Sundays"],
               ["anxious about a new job", "left out by classmates", "restless at night", "unsure about a career"]),
    "opinion": (["What do you think about {x}?", "Give arguments for and against {x}.",
                 "Should more people try {x}?"],
                ["school uniforms", "homework on weekends", "living in a big city", "eating breakfast every day",
                 "learning to code in school", "having a pet as a child", "reading before bed",
                 "travelling alone", "four-day work weeks", "using public transport", "cooking at home",
                 "keeping a diary", "early school start times", "buying second-hand clothes"],
                ["banning cars from city centres", "learning two languages at once", "taking a gap year",
                 "waking up at five in the morning"]),
}


def _chat(split: int):
    """Every (family, phrasing, filler) prompt of one split (1 = training, 2 = held out)."""
    return [p.format(x=x) for fam in CHAT.values() for p in fam[0] for x in fam[split]]


def main() -> None:
    rng = random.Random(0)
    kinds_train = [task.format(t=t) for t in TRAIN_TOPICS for task in TASKS]
    kinds_held = [task.format(t=t) for t in HELD_TOPICS for task in TASKS]
    chat_train, chat_held = _chat(1), _chat(2)
    for s in (kinds_train, kinds_held, chat_train, chat_held):
        rng.shuffle(s)
    train = kinds_train[:600] + chat_train[:600]
    held = kinds_held[:48] + chat_held[:48]
    rng.shuffle(train)
    out = write_splits("draft_prompts.jsonl", train, held)
    print(f"{out}: {len(train)} training prompts ({len(chat_train)} general chat to draw from), {len(held)} held out")


if __name__ == "__main__":
    main()
