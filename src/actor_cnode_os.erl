%% @doc What an owner (actor_cnode) does to its C node's OS process once
%% the port is closed or must be: wait for it to exit, kill it, and remove
%% the shared-memory segment it left. The port gives no message for these,
%% so each polls, every POLL_MS, until a deadline.
-module(actor_cnode_os).

-export([wait_exit/2]).
-export([kill/1]).
-export([alive/1]).
-export([remove_segment/2]).

%% Poll interval while waiting for an OS process to exit: the port is closed,
%% so there is no message to wait for.
-define(POLL_MS, 20).

%% @doc Unlinks shared-memory segment `Name' (actor_nif:remove_segment/1).
%% The lock of a process killed a moment ago goes when its last thread
%% has exited, which can be after its main thread shows as a zombie: a
%% lock still held is asked again until Deadline. (No incarnation of ours
%% can hold it: the next one starts after this.)
-spec remove_segment(binary(), integer()) -> ok | {error, term()}.
remove_segment(Name, Deadline) ->
    case actor_nif:remove_segment(Name) of
        {error, live} = Live ->
            case erlang:monotonic_time(millisecond) >= Deadline of
                true -> Live;
                false ->
                    receive after ?POLL_MS -> ok end,
                    remove_segment(Name, Deadline)
            end;
        Other ->
            Other
    end.

%% @doc kill -9.
-spec kill(non_neg_integer() | undefined) -> ok.
kill(undefined) ->
    ok;
kill(OsPid) ->
    _ = os:cmd("kill -9 " ++ integer_to_list(OsPid) ++ " 2>/dev/null"),
    ok.

%% @doc Waits until the OS process is gone (true) or it is Deadline
%% (monotonic ms; false).
-spec wait_exit(non_neg_integer() | undefined, integer()) -> boolean().
wait_exit(undefined, _Deadline) ->
    true;
wait_exit(OsPid, Deadline) ->
    case alive(OsPid) of
        false -> true;
        true ->
            case erlang:monotonic_time(millisecond) >= Deadline of
                true -> false;
                false -> receive after ?POLL_MS -> wait_exit(OsPid, Deadline) end
            end
    end.

%% @doc Whether the OS process runs (a zombie does not). erl_child_setup
%% reaps our children, so a dead one leaves /proc at once; without /proc
%% (macOS) ask kill -0.
-spec alive(non_neg_integer()) -> boolean().
alive(OsPid) ->
    Pid = integer_to_list(OsPid),
    case filelib:is_dir("/proc/self") of
        true ->
            case file:read_file("/proc/" ++ Pid ++ "/stat") of
                {ok, Stat} -> not zombie(Stat);
                {error, _} -> false
            end;
        false ->
            os:cmd("kill -0 " ++ Pid ++ " 2>/dev/null && echo alive") =:= "alive\n"
    end.

%% /proc/PID/stat: "pid (comm) S ..."; comm may hold spaces and parentheses.
zombie(Stat) ->
    case string:split(Stat, ")", trailing) of
        [_, <<" Z", _/binary>>] -> true;
        [_, <<" X", _/binary>>] -> true;
        _ -> false
    end.
