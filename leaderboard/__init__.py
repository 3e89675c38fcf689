"""The leaderboard site's templates and assets (installed as the data package
`clbench_leaderboard`); `results/` holds the published runs the site is built from."""
