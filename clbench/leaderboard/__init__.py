"""The leaderboard: results files -> entries aggregated over seeds -> a static site."""
