"""What processes send each other: values encoded as data (no pickle),
signed with the run's secret."""
