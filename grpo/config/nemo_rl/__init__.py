"""NeMo-RL's recipe files as a second input format: `recipe` loads them (``defaults:``, interpolation), `rules`
translates them key by key into the native config, `gym_rules` the NeMo-Gym keys."""
