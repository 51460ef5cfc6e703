defmodule ElixirApp.MixProject do
  use Mix.Project

  # actor_pool is a rebar3 project: mix builds it with rebar3. Offline, tell
  # mix which rebar3 to use: MIX_REBAR3=/usr/bin/rebar3 (or once:
  # `mix local.rebar rebar3 /usr/bin/rebar3`). No hex package is needed.
  def project do
    [
      app: :elixir_app,
      version: "0.1.0",
      elixir: "~> 1.14",
      deps: [{:actor_pool, path: "../..", manager: :rebar3}]
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end
end
