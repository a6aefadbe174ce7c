"""The job around a rank: the site profile, the rank's identity, and the plan file the ranks share."""
