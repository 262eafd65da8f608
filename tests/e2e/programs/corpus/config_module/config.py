# Settings as module globals: main() overwrites them from the command line.
lr = 0.5
scale = 1.0
history = []
