"""Engine: the core loop (schedule -> execute -> update), offline and async front ends, output processing."""
