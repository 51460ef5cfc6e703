# The C nodes reach this BEAM over distributed Erlang: make it a node (and
# start epmd if none runs), then start the application.
:ok = :actor_dist.ensure_distributed()
{:ok, _} = Application.ensure_all_started(:actor_pool)
ExUnit.after_suite(fn _ -> :ok = Application.stop(:actor_pool) end)
ExUnit.start()
