"""Natural-text paragraphs that synthetic prompts are cut from (varied topics and registers: chat requests,
instructions, narrative, technical prose), so prompts tokenize and attend like real text, not random ids.

Shared with benchmarks/serve_vs_hf.py: its workload is defined on this exact list."""

CORPUS = [
    "The old lighthouse on the northern cape was switched off in 1987, but the keeper's cottage is still "
    "lived in. Every autumn the family that owns it repaints the window frames a pale green, because salt "
    "eats through anything darker within a single winter.",
    "To make a basic vinaigrette, whisk one part vinegar with three parts olive oil, add a pinch of salt and "
    "a spoonful of mustard, then taste it on a leaf of lettuce rather than on a spoon. Dressing always tastes "
    "sharper on its own than it does on the salad.",
    "A binary search halves the interval it looks at on every comparison, so a sorted list of a million "
    "entries needs at most twenty comparisons. The classic bug is computing the midpoint as (low + high) / 2, "
    "which overflows in languages with fixed-width integers.",
    "Could you help me plan a three-day trip to Lisbon in early spring? I like walking, small museums and "
    "seafood, but I would rather avoid crowded tourist restaurants. I will arrive by train on a Thursday "
    "evening and leave on Sunday afternoon.",
    "The committee met on Tuesday to review the budget for the new library wing. Construction costs have risen "
    "by eleven percent since the original estimate, mostly because of steel prices, and the architect proposed "
    "replacing the glass atrium with a simpler timber roof.",
    "Honeybees communicate the direction of a food source with a waggle dance. The angle of the dance relative "
    "to vertical on the comb matches the angle between the sun and the flowers, and the length of the waggle "
    "run tells the other bees roughly how far away they are.",
    "My sourdough starter has been sluggish since the kitchen got colder. It still doubles, but it takes ten "
    "hours instead of five, and the bread comes out dense. Should I feed it more often, switch to a different "
    "flour, or just find a warmer spot for the jar?",
    "In the winter of 1814 the Thames froze so thoroughly that a fair was held on the ice for four days. "
    "Printers set up presses on the river and sold souvenir cards, and an elephant was reportedly led across "
    "the ice below Blackfriars Bridge.",
    "When a database query suddenly gets slow, look at the query plan before anything else. A missing index, "
    "a statistics table that has gone stale, or a parameter that changed the estimated row count can each turn "
    "an index lookup into a full scan of the table.",
    "The hike to the upper lake starts at the car park behind the village church. Follow the river for about "
    "two kilometres, cross the wooden bridge, and take the steep path on the left through the pine forest. "
    "Allow four hours there and back, and carry water.",
    "Please write a short, friendly email to my landlord explaining that the heating in the bathroom has not "
    "worked for two weeks, that I reported it on the fifth, and asking when a technician can come. I am at "
    "home most mornings.",
    "Photosynthesis captures light in two stages. The light-dependent reactions split water and store energy "
    "in ATP and NADPH; the Calvin cycle then uses that energy to fix carbon dioxide into sugars, which is why "
    "plants need both light and air to grow.",
    "The quarterly report shows revenue up six percent, driven by the subscription business, while hardware "
    "sales fell for the third quarter in a row. Management expects margins to improve once the new warehouse "
    "is running at full capacity next year.",
    "Chess openings are less about memorising moves than about understanding plans. In the Italian game, "
    "White develops quickly, aims a bishop at the weak f7 square, and prepares a central pawn break, while "
    "Black tries to equalise by challenging the centre early.",
    "Our team is moving from a nightly batch job to a streaming pipeline. Events arrive out of order by up to "
    "ten minutes, some are duplicated, and the downstream dashboard must never show a number go backwards. "
    "What windowing strategy would you recommend?",
    "The violinist tuned her instrument twice before the concert, once in the cold green room and again on "
    "the warm stage, because the strings stretch as the wood warms up. Even so, the A string had drifted "
    "slightly flat by the end of the second movement.",
]
