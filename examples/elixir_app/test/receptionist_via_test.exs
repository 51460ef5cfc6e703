defmodule ReceptionistViaTest do
  use ExUnit.Case

  # A GenServer to name through the receptionist.
  defmodule Named do
    use GenServer

    @impl true
    def init(state), do: {:ok, state}

    @impl true
    def handle_call(:whoami, _from, state), do: {:reply, {self(), node()}, state}
  end

  test "a GenServer named {:via, :actor_receptionist, name}: called by name, taken, freed when it stops" do
    name = {:via, :actor_receptionist, {:ex_session, 42}}
    key = :actor_receptionist.name_key({:ex_session, 42})
    {:ok, pid} = GenServer.start_link(Named, :ok, name: name)
    assert ^pid = GenServer.whereis(name)
    assert [^pid] = :actor_receptionist.lookup(key)
    assert {^pid, _} = GenServer.call(name, :whoami)
    assert {:error, {:already_started, ^pid}} = GenServer.start(Named, :ok, name: name)
    # Stopped: the next one gets the name at once.
    :ok = GenServer.stop(name)
    {:ok, pid2} = GenServer.start(Named, :ok, name: name)
    assert ^pid2 = GenServer.whereis(name)
    :ok = GenServer.stop(pid2)
    wait_until(fn -> :actor_receptionist.lookup(key) == [] end)
    assert nil == GenServer.whereis(name)
  end

  test "a watched registration goes when its process dies; a plain one stays" do
    watched = ElixirApp.key("ex.watched")
    plain = ElixirApp.key("ex.plain")
    provider = spawn(fn -> Process.sleep(:infinity) end)
    :ok = :actor_receptionist.register(watched, provider, self(), %{watch: true})
    assert_receive {:registered, ^watched, ^provider}
    :ok = :actor_receptionist.register(plain, provider, self())
    assert_receive {:registered, ^plain, ^provider}
    Process.exit(provider, :kill)
    wait_until(fn -> :actor_receptionist.lookup(watched) == [] end)
    assert [^provider] = :actor_receptionist.lookup(plain)
    :ok = :actor_receptionist.deregister(plain, provider)
    assert {:error, {:badarg, {:opts, %{watch: :yes}}}} =
             :actor_receptionist.register(watched, self(), self(), %{watch: :yes})
  end

  defp wait_until(pred, deadline \\ System.monotonic_time(:millisecond) + 10_000) do
    cond do
      pred.() -> :ok
      System.monotonic_time(:millisecond) > deadline -> flunk("never true")
      true -> receive do after 10 -> wait_until(pred, deadline) end
    end
  end
end
