"""The job around a rank: the site profile, who this rank is, and the plan file the ranks share."""
