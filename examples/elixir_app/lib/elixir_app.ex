defmodule ElixirApp do
  @moduledoc """
  actor_pool from Elixir: a pool of native echo workers registered with the
  receptionist under a service key, called by pid, by key and with
  `GenServer.call/2`; and the receptionist used from Elixir processes.

  Every call is a plain Erlang call (`:actor_pool`, `:actor_receptionist`);
  this module only gives the tour a name.
  """

  @doc "The service key for `id` (a string, an atom or a binary)."
  @spec key(String.t() | atom()) :: {:service_key, binary()}
  def key(id), do: :actor_receptionist.service_key(id)

  @doc """
  Starts a pool of `workers` echo workers named `name`, registered under
  the service id `id`: any node of the cluster finds it and calls it by key.
  """
  @spec start_echo(atom(), String.t(), pos_integer()) :: {:ok, pid()} | {:error, term()}
  def start_echo(name, id, workers \\ 2) do
    :actor_pool.start_pool(name, :echo, %{workers: workers, service_key: id})
  end

  @doc "Asks whichever pool is registered under `id`."
  @spec ask_by_key(String.t(), term(), timeout()) :: {:ok, term()} | {:error, term()}
  def ask_by_key(id, msg, timeout \\ 5000), do: :actor_pool.ask(key(id), msg, timeout)
end
