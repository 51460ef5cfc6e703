defmodule ElixirAppTest do
  use ExUnit.Case

  test "a pool: ask, tell and GenServer.call by pid, calls by key" do
    {:ok, pool} = ElixirApp.start_echo(:ex_echo, "ex.echo")
    assert {:ok, "hi"} = :actor_pool.ask(pool, "hi", 5000)
    assert :ok = :actor_pool.tell(pool, "fire and forget")
    # A pool answers gen_server calls itself.
    assert {:ok, "call"} = GenServer.call(pool, "call")
    # Registered before start_pool returned: found and called by key.
    assert [^pool] = :actor_receptionist.lookup(ElixirApp.key("ex.echo"))
    assert {:ok, %{"a" => 1}} = ElixirApp.ask_by_key("ex.echo", %{"a" => 1})
    assert %{processed: processed} = wait_stats(pool, &(&1.processed >= 4))
    assert processed >= 4
    assert :ok = :actor_pool.stop_pool(pool)
    assert [] = :actor_receptionist.lookup(ElixirApp.key("ex.echo"))
    assert {:error, :no_pool} = ElixirApp.ask_by_key("ex.echo", "gone")
  end

  test "the receptionist from Elixir processes: subscribe, register, find, deregister" do
    key = ElixirApp.key("ex.service")
    me = self()
    :ok = :actor_receptionist.subscribe(key, me)
    assert_receive {:listing, ^key, []}
    provider = spawn(fn -> Process.sleep(:infinity) end)
    :ok = :actor_receptionist.register(key, provider, me)
    assert_receive {:registered, ^key, ^provider}
    assert_receive {:listing, ^key, [^provider]}
    assert [^provider] = :actor_receptionist.lookup(key)
    :ok = :actor_receptionist.find(key, me)
    assert_receive {:listing, ^key, [^provider]}
    :ok = :actor_receptionist.deregister(key, provider, me)
    assert_receive {:deregistered, ^key, ^provider}
    assert_receive {:listing, ^key, []}
    :ok = :actor_receptionist.unsubscribe(key, me)
    Process.exit(provider, :kill)
  end

  test "a pool in a Supervisor (:actor_pool.child_spec/3): asked, gone with the supervisor" do
    name = :ex_supervised
    children = [:actor_pool.child_spec(name, :echo, %{workers: 2})]
    {:ok, sup} = Supervisor.start_link(children, strategy: :one_for_one)
    # The child is the pool's owner, a process of this node; the pool is
    # called by name.
    assert [{{:actor_pool, ^name}, owner, :worker, [:actor_pool_owner]}] =
             Supervisor.which_children(sup)
    assert {:ok, "hi"} = :actor_pool.ask(name, "hi", 5000)
    assert List.keymember?(:actor_pool.which_pools(), name, 0)
    :ok = Supervisor.stop(sup)
    # Stopped by its owner before the supervisor was done.
    refute Process.alive?(owner)
    assert {:error, :noproc} = :actor_pool.stats(name)
    refute List.keymember?(:actor_pool.which_pools(), name, 0)
    assert {:error, :noproc} = :actor_pool.ask(name, "gone", 5000)
  end

  test "a map child spec: a killed owner is replaced, with a pool, not :already_started" do
    name = :ex_restarted
    spec = %{id: :pool, start: {:actor_pool, :start_link, [name, :echo, %{workers: 1}]}}
    {:ok, sup} = Supervisor.start_link([spec], strategy: :one_for_one)
    [{:pool, owner, :worker, _}] = Supervisor.which_children(sup)
    assert {:ok, "first"} = :actor_pool.ask(name, "first", 5000)
    Process.exit(owner, :kill)

    wait_until(fn ->
      match?([{:pool, new, _, _}] when is_pid(new) and new != owner, Supervisor.which_children(sup))
    end)

    assert {:ok, "again"} = :actor_pool.ask(name, "again", 5000)
    :ok = Supervisor.stop(sup)
    assert {:error, :noproc} = :actor_pool.stats(name)
    refute List.keymember?(:actor_pool.which_pools(), name, 0)
  end

  test "bad input is {:error, {:badarg, ...}}" do
    assert {:error, {:badarg, {:workers, 0}}} =
             :actor_pool.start_pool(:ex_bad, :echo, %{workers: 0})
    assert {:error, {:badarg, {:key, 42}}} = :actor_receptionist.register(42, self())
    assert {:error, {:badarg, {:workers, 0}}} = :actor_pool.start_link(:ex_bad, :echo, %{workers: 0})
  end

  defp wait_until(fun, deadline \\ System.monotonic_time(:millisecond) + 10_000) do
    cond do
      fun.() -> :ok
      System.monotonic_time(:millisecond) > deadline -> flunk("condition not met within 10 s")
      true -> receive do after 10 -> wait_until(fun, deadline) end
    end
  end

  defp wait_stats(pool, pred, deadline \\ System.monotonic_time(:millisecond) + 10_000) do
    stats = :actor_pool.stats(pool)

    cond do
      is_map(stats) and pred.(stats) -> stats
      System.monotonic_time(:millisecond) > deadline -> flunk("stats never matched: #{inspect(stats)}")
      true -> receive do after 10 -> wait_stats(pool, pred, deadline) end
    end
  end
end
