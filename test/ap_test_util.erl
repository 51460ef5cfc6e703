%% @doc Helpers shared by the EUnit modules: polling with a deadline instead
%% of sleeping, and checks that a test left no OS process or epmd name behind.
-module(ap_test_util).

-export([wait_until/2, epmd_names/0, os_pid_alive/1, temp_dir/1, stop_app/1]).

-define(POLL_MS, 10).

%% Poll Fun until it returns true; fail the test after TimeoutMs.
-spec wait_until(fun(() -> boolean()), non_neg_integer()) -> ok.
wait_until(Fun, TimeoutMs) ->
    wait_until(Fun, erlang:monotonic_time(millisecond) + TimeoutMs, TimeoutMs).

wait_until(Fun, Deadline, TimeoutMs) ->
    case Fun() of
        true -> ok;
        false ->
            case erlang:monotonic_time(millisecond) >= Deadline of
                true -> error({condition_not_met_within_ms, TimeoutMs});
                false ->
                    receive after ?POLL_MS -> ok end,
                    wait_until(Fun, Deadline, TimeoutMs)
            end
    end.

%% Names registered with the local epmd.
-spec epmd_names() -> [string()].
epmd_names() ->
    case net_adm:names() of
        {ok, Names} -> [Name || {Name, _Port} <- Names];
        {error, _} -> []
    end.

%% An OS process that exists and is not a zombie.
-spec os_pid_alive(non_neg_integer()) -> boolean().
os_pid_alive(OsPid) ->
    case file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/stat") of
        {ok, Stat} ->
            case string:split(Stat, ")", trailing) of
                [_, <<" Z", _/binary>>] -> false;
                _ -> true
            end;
        {error, _} -> false
    end.

%% A fresh 0700 directory under $TMPDIR (or /tmp), named after Prefix.
-spec temp_dir(string()) -> file:filename().
temp_dir(Prefix) ->
    Base = case os:getenv("TMPDIR") of
               T when is_list(T), T =/= "" -> T;
               _ -> "/tmp"
           end,
    Dir = filename:join(Base, Prefix ++ "_"
                        ++ integer_to_list(erlang:unique_integer([positive]))
                        ++ "_" ++ os:getpid()),
    ok = file:make_dir(Dir),
    ok = file:change_mode(Dir, 8#700),
    Dir.

%% Stops the application, and distribution too when the test setup started it.
-spec stop_app(WasAlive :: boolean()) -> ok.
stop_app(WasAlive) ->
    ok = application:stop(actor_pool),
    case WasAlive of
        true -> ok;
        false -> ok = net_kernel:stop()
    end.
