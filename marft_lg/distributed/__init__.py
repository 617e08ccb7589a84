"""Past one machine on Ray (the optional extra `marft_lg[ray]`): rollout-worker actors, each with its own engine and
the user's app, return trajectories to the learner; mining and compare replays fan out over the same cluster.
Nothing here is imported unless a `ray:` config section (or `ray=`) asks for it."""
