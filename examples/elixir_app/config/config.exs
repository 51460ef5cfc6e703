import Config

# The C nodes log their start and stop at info; keep test output short.
config :logger, level: :warning
