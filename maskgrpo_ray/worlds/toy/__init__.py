"""The toy world: "<count> <colour> dots on the <position>" on a palette grid (docs/toy_world.md).

``sim`` is the simulated accelerator (model kind ``sim``: the toy policy with a cost profile);
``world`` holds the grammar, the scenes, the palette decoder and GenEval's rule on toy pixels;
``model`` the toy policy, its pre-training and its registry entry (model kind ``toy``, prompt set
``toy``); ``rewards`` the rule rewards (``toy_rules``, ``toy_geneval``).
"""
